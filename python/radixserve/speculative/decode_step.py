"""How a decode step becomes a verify step: the BatchBuilder hands its running batch here instead of
calling prepare_for_decode() directly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from radixserve.speculative.batch_gate import PROBE_AFTER, StepCosts, step_pays
from radixserve.speculative.model_drafter import ModelDrafter
from radixserve.speculative.ngram_drafter import NgramConfig, NgramDrafter, SpecReqState
from radixserve.speculative.tree import DraftTree
from radixserve.speculative.verify_batch import prepare_for_verify, verify_tokens_needed

if TYPE_CHECKING:
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

    def __init__(self, drafter: Drafter, mem: KVMemory, batch_backoff: bool = True) -> None:
        self.drafter = drafter
        self.mem = mem
        self.batch_backoff = batch_backoff  # the batch-level rule (batch_gate.py)
        self.costs = StepCosts()  # decode / verify step times, for the batch-level rule

    @classmethod
    def from_server_args(cls, args: ServerArgs, mem: KVMemory) -> SpeculativeDecodeStep | None:
        if args.speculative_algorithm is None:
            return None
        gate = not args.disable_speculative_batch_backoff
        if args.speculative_algorithm == "NGRAM":
            return cls(NgramDrafter(NgramConfig.from_server_args(args)), mem, gate)
        assert args.speculative_num_draft_tokens is not None, "ServerArgs.resolve() sets it"
        return cls(ModelDrafter(args.speculative_num_draft_tokens), mem, gate)

    def prepare(self, batch: ScheduleBatch, context_limit: int) -> None:
        drafts = [self.drafter.draft(r, context_limit - r.kv_committed_len - 1) for r in batch.reqs]
        if any(drafts) and not self._pays(batch.reqs, drafts):
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

    def observe_step(self, verify: bool, bs: int, seconds: float) -> None:
        """The scheduler reports each decode / verify step's wall time (batch_gate.StepCosts)."""
        self.costs.observe(verify, bs, seconds)

    def _pays(self, reqs: list[Req], drafts: list) -> bool:
        """The batch-level rule (batch_gate.py); drafters without its state (test oracles) always
        pass. A step that does not pay leaves its would-be drafters a gated step older."""
        states = [(r.spec, len(d)) for r, d in zip(reqs, drafts) if d and isinstance(r.spec, SpecReqState)]
        if not states or not self.batch_backoff:
            return True
        gain = sum(st.expected_accepts(n) for st, n in states)
        probe = any(st.gated_streak >= PROBE_AFTER for st, _ in states)
        if step_pays(gain, len(reqs), self.costs, probe):
            return True
        for st, _ in states:
            st.on_gated()
        return False
