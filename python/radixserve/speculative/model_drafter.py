"""The scheduler's side of drafting with a model (STANDALONE / self-speculation): it decides who
drafts and how many tokens (same eligibility and back-off rule as NGRAM) and reserves their KV; the
model worker computes the draft tokens themselves right before the verify forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.speculative.ngram_drafter import SpecReqState, can_speculate, num_drafts_allowed

if TYPE_CHECKING:
    from radixserve.scheduler.req import Req

PLACEHOLDER_TOKEN = 0  # overwritten by the worker's draft model before the verify forward


class ModelDrafter:
    def __init__(self, num_draft_tokens: int) -> None:
        self.num_draft_tokens = num_draft_tokens

    def draft(self, req: Req, max_tokens: int) -> list[int]:
        if not can_speculate(req):
            return []
        if req.spec is None:
            req.spec = SpecReqState(trie=None)
        n = num_drafts_allowed(req, req.spec, self.num_draft_tokens - 1, max_tokens)
        return [PLACEHOLDER_TOKEN] * max(n, 0)
