"""NGRAM drafting for the requests of a decode step, and the back-off rule.

Who drafts: requests without a grammar, penalties, a logit_bias, logprobs, hidden states, a seed
or a pending min_new_tokens.
Greedy ones (temperature 0 or top_k 1) accept while the target's argmax agrees, so the output is
exactly what plain greedy decoding gives; sampled ones are verified by rejection sampling, which
keeps the target's distribution (speculative/verify.py). Every other request rides in the same
verify forward with no drafts (one token, sampled by the ordinary sampler): correct, not sped up.

Back-off: drafting costs a wider forward. A request whose drafts were all rejected stops drafting
for `cooldown` decode steps; the cooldown doubles on each further all-rejected round (1, 2, 4 ..
MAX_COOLDOWN) and goes back to 0 on any accepted draft. On random text most rounds are rejected,
so a request there drafts on only about one step in MAX_COOLDOWN; on copy-heavy text it keeps
drafting. When no request of a step drafts, the step is an ordinary DECODE batch (with its fast
paths). A batch-level rule then sets how many tokens each request drafts and whether the step
drafts at all (batch_gate.py), from each draft's chance of acceptance (SpecReqState.draft_alphas:
the request's own record and, for NGRAM chains, how often drafts matched on as long a context were
accepted, MatchAcceptance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.speculative.ngram_trie import NgramTrie
from radixserve.speculative.tree import DraftTree

if TYPE_CHECKING:
    from radixserve.scheduler.req import Req
    from radixserve.server_args import ServerArgs

MAX_COOLDOWN = 16
ACCEPT_DECAY = 0.7  # weight of the earlier rounds in a request's acceptance counts, per round
MATCH_DECAY = 0.99  # the same for MatchAcceptance's counts, per draft counted at that length
# The prior of the acceptance estimates: one accepted and one rejected draft (alpha 1/2).
PRIOR_ACCEPTED = 1.0
PRIOR_REJECTED = 1.0


class MatchAcceptance:
    """How often an NGRAM draft is accepted, given that the drafts before it in its chain were, by
    the length of the context it was matched on: one table per server, learned from every verify
    step (decayed counts). A draft j (1-based) of a chain whose first token was matched on a
    w-token suffix continues that match: its context is w + j - 1 tokens long.

    Why: a request's own record alone reacts late. Answers to copy tasks open with a few new words
    (whose short matches are mostly rejected) and then copy at length, where long matches are
    nearly always right: the match length tells the two apart as soon as the copying starts."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self._counts: dict[int, list[float]] = {}  # length -> [accepted, rejected]
        self._best = self.alpha(1)  # best(), kept current by observe (read per request per step)

    def alpha(self, length: int) -> float:
        accepted, rejected = self._counts.get(min(length, self.max_length), (PRIOR_ACCEPTED, PRIOR_REJECTED))
        return accepted / (accepted + rejected)

    def best(self) -> float:
        """The best alpha at any length 1 .. max_length (a length not yet recorded has the prior's)."""
        return self._best

    def observe(self, window: int, num_drafts: int, num_accepted: int) -> None:
        """A verified chain matched on `window` tokens: drafts 1 .. num_accepted were accepted and
        the next one (if any was drafted) rejected; those past it tell nothing."""
        for j in range(1, min(num_accepted + 1, num_drafts) + 1):
            counts = self._counts.setdefault(
                min(window + j - 1, self.max_length), [PRIOR_ACCEPTED, PRIOR_REJECTED]
            )
            counts[0] *= MATCH_DECAY
            counts[1] *= MATCH_DECAY
            counts[0 if j <= num_accepted else 1] += 1.0
        self._best = max(self.alpha(length) for length in range(1, self.max_length + 1))


@dataclass(frozen=True)
class NgramConfig:
    num_draft_tokens: int  # tokens per request in a verify forward (1 + drafts)
    min_window: int
    max_window: int
    branch_length: int
    capacity: int
    min_breadth: int = 1  # BFS tree breadth (SGLang's min/max_bfs_breadth); max 1: a chain
    max_breadth: int = 1

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> NgramConfig:
        assert args.speculative_num_draft_tokens is not None, "ServerArgs.resolve() sets it"
        return cls(
            num_draft_tokens=args.speculative_num_draft_tokens,
            min_window=args.speculative_ngram_min_match_window_size,
            max_window=args.speculative_ngram_max_match_window_size,
            branch_length=args.speculative_ngram_branch_length,
            capacity=args.speculative_ngram_capacity,
            min_breadth=args.speculative_ngram_min_bfs_breadth,
            max_breadth=args.speculative_ngram_max_bfs_breadth or 1,
        )


@dataclass
class SpecReqState:
    """Per-request speculation state (lives on Req.spec; survives retraction)."""

    trie: NgramTrie | None  # None for drafters that need no index (a draft model)
    matches: MatchAcceptance | None = None  # NGRAM's per-server table
    window: int = 0  # the context length the drafts in flight were matched on (0: unknown)
    cooldown: int = 0  # decode steps left without drafting
    next_cooldown: int = 1
    # The batch-level rule (batch_gate.py): decayed counts of accepted drafts and of rounds that
    # ended on a rejected draft, whose ratio estimates alpha (each draft's chance to be accepted
    # given the ones before it were); and steps held back in a row.
    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    gated_streak: int = 0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def draft_alphas(self, n: int) -> list[float]:
        """Each of n drafts' chance to be accepted given the ones before it were: the request's own
        alpha, raised where the server's record at that draft's match length (MatchAcceptance) is
        better, to the geometric mean of the two. Raised only: the server's record comes from other
        requests' text, and lowering a request's own good record by it drafted less on text that
        repeats itself (random prompts at concurrency 4, whose acceptance length halved)."""
        if self.matches is None or self.window <= 0:
            return [self.alpha] * n
        return [
            max(self.alpha, math.sqrt(self.alpha * self.matches.alpha(self.window + j))) for j in range(n)
        ]

    def best_first_alpha(self) -> float:
        """An upper bound of draft_alphas(1)[0] before the match is known."""
        if self.matches is None:
            return self.alpha
        return max(self.alpha, math.sqrt(self.alpha * self.matches.best()))

    def on_gated(self) -> None:
        """This step's drafts were dropped (or not made) by the batch-level rule."""
        self.gated_streak += 1

    def on_token(self, token_id: int) -> None:
        """Every token appended to the request's output (any batch mode) is indexed."""
        if self.trie is not None:
            self.trie.extend([token_id])

    def on_verified(self, num_drafts: int, num_accepted: int) -> None:
        """The back-off rules, after a verify round in which the request drafted."""
        if num_drafts == 0:
            return
        if self.matches is not None and self.window > 0:
            self.matches.observe(self.window, num_drafts, num_accepted)
        self.gated_streak = 0
        self.accepted = ACCEPT_DECAY * self.accepted + num_accepted
        self.rejected = ACCEPT_DECAY * self.rejected + (1.0 if num_accepted < num_drafts else 0.0)
        if num_accepted == 0:
            self.cooldown = self.next_cooldown
            self.next_cooldown = min(self.next_cooldown * 2, MAX_COOLDOWN)
        else:
            self.cooldown, self.next_cooldown = 0, 1


def can_speculate(req: Req) -> bool:
    p = req.sampling_params
    greedy = p.temperature < 1e-6 or p.top_k == 1
    # Sampled requests are verified by rejection sampling (same distribution, other draws): a
    # seeded one would no longer reproduce its non-speculative output, so it does not draft.
    return (
        (greedy or p.seed is None)
        and req.grammar is None
        and not req.return_logprob
        and not req.return_hidden_states  # its rows are one per token, as without speculation
        and req.input_embeds is None  # its prompt's ids are placeholders: nothing to draft from
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
        and p.repetition_penalty == 1.0
        and not p.logit_bias
        and len(req.output_ids) >= p.min_new_tokens
    )


def num_drafts_allowed(req: Req, st: SpecReqState, most: int, max_tokens: int) -> int:
    """How many drafts `req` may have this step: 0 while cooling down (the per-request back-off),
    and never past max_new_tokens (tokens beyond it would be dropped anyway)."""
    if st.cooldown > 0:
        st.cooldown -= 1
        return 0
    room = req.sampling_params.max_new_tokens - len(req.output_ids) - 1
    return min(most, max_tokens, room)


class NgramDrafter:
    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self.matches = MatchAcceptance(config.max_window)

    def _state(self, req: Req) -> SpecReqState:
        if req.spec is None:
            trie = NgramTrie(self.config.branch_length, self.config.capacity)
            trie.extend(req.origin_input_ids + req.output_ids)
            req.spec = SpecReqState(trie, self.matches)
        return req.spec

    def draft(self, req: Req, max_tokens: int) -> list[int] | DraftTree:
        """This step's drafts for `req` (possibly none): a chain, or with max_breadth > 1 SGLang's
        BFS tree."""
        if not can_speculate(req):
            return []
        st = self._state(req)
        cfg = self.config
        st.window = 0
        n = num_drafts_allowed(req, st, cfg.num_draft_tokens - 1, max_tokens)
        if n <= 0:
            return []
        assert st.trie is not None
        context = last_tokens(req, cfg.max_window)
        if cfg.max_breadth > 1:
            return st.trie.draft_tree(
                context, n, cfg.min_window, cfg.max_window, cfg.min_breadth, cfg.max_breadth
            )
        drafts, st.window = st.trie.draft_chain(context, n, cfg.min_window, cfg.max_window)
        return drafts


def last_tokens(req: Req, n: int) -> list[int]:
    """The last n tokens of prompt + output, without copying the whole sequence (runs every
    decode step for every drafting request)."""
    out = req.output_ids[-n:]
    if len(out) < n and req.origin_input_ids:
        out = req.origin_input_ids[-(n - len(out)) :] + out
    return out
