"""How a decode step becomes a verify step: the BatchBuilder hands its running batch here instead of
calling prepare_for_decode() directly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from radixserve.distributed.rank_runtime import LocalSync
from radixserve.speculative.batch_gate import (
    PROBE_AFTER,
    RowCost,
    StepCosts,
    draft_length,
    expected_accepts,
    step_pays,
)
from radixserve.speculative.model_drafter import ModelDrafter
from radixserve.speculative.ngram_drafter import NgramConfig, NgramDrafter, SpecReqState
from radixserve.speculative.tree import DraftTree, as_tree, depths
from radixserve.speculative.verify_batch import prepare_for_verify, verify_tokens_needed

if TYPE_CHECKING:
    from radixserve.distributed.rank_runtime import RankSync
    from radixserve.scheduler.kv_memory import KVMemory
    from radixserve.scheduler.req import Req
    from radixserve.scheduler.schedule_batch import ScheduleBatch
    from radixserve.server_args import ServerArgs


class Drafter(Protocol):
    """Proposes drafts. It keeps its per-request state on req.spec, an object with
    on_token(token_id) (every appended token) and on_verified(num_drafts, num_accepted)."""

    def draft(self, req: Req, max_tokens: int) -> list[int] | DraftTree: ...


class SpeculativeDecodeStep:
    """Drafts for every request of a decode batch; a TARGET_VERIFY batch when any request drafted
    and the drafts' KV fits (else, or with no drafts, the ordinary DECODE batch)."""

    def __init__(
        self,
        drafter: Drafter,
        mem: KVMemory,
        batch_backoff: bool = True,
        max_drafts: int = 64,
        sync: RankSync | None = None,
    ) -> None:
        self.drafter = drafter
        self.mem = mem
        self.batch_backoff = batch_backoff  # the batch-level rule and draft lengths (batch_gate.py)
        self.max_drafts = max_drafts  # per request (num-draft-tokens - 1)
        self.costs = StepCosts()  # decode / verify step times, for the batch-level rule
        # At TP > 1 every rank must draft alike, so the step times the rule weighs are agreed.
        self.sync: RankSync = sync or LocalSync()

    @classmethod
    def from_server_args(
        cls, args: ServerArgs, mem: KVMemory, sync: RankSync | None = None
    ) -> SpeculativeDecodeStep | None:
        if args.speculative_algorithm is None:
            return None
        gate = not args.disable_speculative_batch_backoff
        assert args.speculative_num_draft_tokens is not None, "ServerArgs.resolve() sets it"
        most = args.speculative_num_draft_tokens - 1
        if args.speculative_algorithm == "NGRAM":
            return cls(NgramDrafter(NgramConfig.from_server_args(args)), mem, gate, most, sync)
        return cls(ModelDrafter(args.speculative_num_draft_tokens), mem, gate, most, sync)

    def prepare(self, batch: ScheduleBatch, context_limit: int) -> None:
        cost = self.costs.row_cost(len(batch.reqs)) if self.batch_backoff else None
        drafts = [
            self._fit(r, self.drafter.draft(r, self._room(r, context_limit, cost)), cost) for r in batch.reqs
        ]
        if any(drafts) and not self._pays(batch.reqs, drafts, cost):
            drafts = []
        if any(drafts):
            committed = [r.kv_committed_len for r in batch.reqs]
            need = verify_tokens_needed(self.mem, committed, [len(d) for d in drafts])
            if self.mem.can_alloc(need):
                prepare_for_verify(batch, drafts)
                return
        # No drafts, or no room for them this step: a plain decode (the back-off rule only counts
        # rounds that were verified).
        batch.prepare_for_decode()

    def observe_step(self, verify: bool, bs: int, rows: int, seconds: float) -> None:
        """The scheduler reports each decode / verify step's wall time and row count
        (batch_gate.StepCosts). Every rank reports every step; each records the slowest rank's
        time. A rank's own clock differs from its peers' (a busy core, a preemption), and a
        different measured cost would make it draft differently: it would run another batch
        than its peers, and the TP collectives would sum rows of different requests."""
        if not self.batch_backoff:
            return  # nothing reads the costs
        self.costs.observe(verify, bs, self.sync.max_step_seconds(seconds), rows)

    def _room(self, req: Req, context_limit: int, cost: RowCost | None) -> int:
        """Drafts `req` may have this step: what its context has room for, or none when not even
        its first draft could pay for its row at the best chance the match might give it (then it
        is held back without a lookup: at batch 4 the lookups of requests that end up not drafting
        cost a few percent of the step)."""
        room = context_limit - req.kv_committed_len - 1
        st = req.spec
        if cost is None or not isinstance(st, SpecReqState) or st.gated_streak >= PROBE_AFTER:
            return room
        if st.best_first_alpha() <= cost.per_row:
            st.on_gated()
            return 0
        return room

    def _fit(self, req: Req, drafts: list[int] | DraftTree, cost: RowCost | None) -> list[int] | DraftTree:
        """`req`'s drafts cut to the length their acceptance pays for at the measured cost of a row
        (batch_gate.draft_length; a tree keeps its first rows, breadth first). Drafts are made at
        full length first: an NGRAM chain's chances depend on the context it matched. Drafters
        without that state (test oracles), and steps before costs are measured, keep them all."""
        st = req.spec
        if cost is None or not drafts or not isinstance(st, SpecReqState):
            return drafts
        n = draft_length(st.draft_alphas(min(len(drafts), self.max_drafts)), cost)
        if n == 0:
            if st.gated_streak < PROBE_AFTER:
                st.on_gated()
                return []
            n = 1  # a probe: one draft re-measures its acceptance
        if isinstance(drafts, DraftTree):
            return DraftTree(drafts.tokens[:n], drafts.parents[:n])
        return drafts[:n]

    def _pays(self, reqs: list[Req], drafts: list, cost: RowCost | None) -> bool:
        """The batch-level rule (batch_gate.py); drafters without its state (test oracles) always
        pass. A step that does not pay leaves its would-be drafters a gated step older."""
        states = [(r.spec, d) for r, d in zip(reqs, drafts) if d and isinstance(r.spec, SpecReqState)]
        if not states or not self.batch_backoff:
            return True
        # A tree's rows past its depth are alternatives: its chance of acceptance is counted along
        # its depth (a lower bound); every row is paid for.
        gain = sum(
            expected_accepts(st.draft_alphas(max(depths(as_tree(d).row_parents())))) for st, d in states
        )
        rows = sum(len(d) for d in drafts)
        probe = any(st.gated_streak >= PROBE_AFTER for st, _ in states)
        if step_pays(gain, rows, cost, probe):
            return True
        for st, _ in states:
            st.on_gated()
        return False
