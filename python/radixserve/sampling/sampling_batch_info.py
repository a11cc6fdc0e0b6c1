"""Per-batch sampling parameters as tensors, kept row-aligned with the scheduler's batch.

The scheduler builds one with `from_reqs`, calls `filter` as requests finish and `merge` when a
prefill batch joins the running batch; every tensor and the penalty state follow the same row order.
Penalty counts catch up with the requests' outputs through `sync_output_tokens` before each sample.
`filter`/`merge` rebind attributes to new tensors instead of writing in place, so a shallow
`copy_for_forward()` handed to an in-flight forward pass is not disturbed by them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from radixserve.sampling.custom_rows import CustomRows
from radixserve.sampling.penalties import PenaltyState, merge_optional
from radixserve.sampling.sampling_params import GREEDY_EPS
from radixserve.sampling.vocab_mask import VocabMask

# -1 marks "unseeded", so seeds live in [0, 2**63). Requests are refused outside [0, SEED_MAX]
# (SamplingParams.verify); the fold only keeps params built past that check from overflowing int64.
_SEED_MOD = 1 << 63


@dataclass
class SamplingBatchInfo:
    temperatures: Tensor  # [bs, 1] fp32 (1.0 for greedy rows)
    top_ps: Tensor  # [bs] fp32
    top_ks: Tensor  # [bs] int64, in [1, vocab_size]; vocab_size = no cut, 1 = greedy
    min_ps: Tensor  # [bs] fp32
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    seeds: Tensor | None  # [bs] int64, -1 = unseeded; None when no row is seeded
    penalizer: PenaltyState | None  # None when no row uses a penalty or min_new_tokens
    vocab_size: int
    device: torch.device
    vocab_mask: VocabMask | None = None  # the constrained rows' allowed tokens; set per step by grammar
    custom: CustomRows | None = None  # rows with a custom logit processor (None: no row has one)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_reqs(
        cls,
        reqs: Sequence[Any],
        vocab_size: int,
        device: str | torch.device,
        eos_token_ids: Sequence[int] = (),
    ) -> SamplingBatchInfo:
        """Reads req.sampling_params, req.origin_input_ids, req.output_ids (and optionally
        req.eos_token_ids). `eos_token_ids` are the model's EOS ids, suppressed together with each
        request's stop_token_ids until it has generated min_new_tokens tokens."""
        device = torch.device(device)
        params = [r.sampling_params for r in reqs]
        greedy = [p.temperature < GREEDY_EPS or p.top_k == 1 for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_ks = [1 if g else _clamp_top_k(p.top_k, vocab_size) for p, g in zip(params, greedy)]
        seeds = None
        if any(p.seed is not None for p in params):
            seeds = torch.tensor(
                [-1 if p.seed is None else p.seed % _SEED_MOD for p in params],
                dtype=torch.int64,
                device=device,
            )
        suppress_ids = [_suppress_ids(r, eos_token_ids) for r in reqs]
        info = cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device).view(-1, 1),
            top_ps=torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor([float(p.min_p) for p in params], dtype=torch.float32, device=device),
            is_all_greedy=False,
            need_top_p=False,
            need_top_k=False,
            need_min_p=False,
            seeds=seeds,
            penalizer=PenaltyState.from_reqs(reqs, vocab_size, device, suppress_ids),
            vocab_size=vocab_size,
            device=device,
            custom=CustomRows.from_reqs(reqs),
        )
        info._update_flags()
        return info

    @property
    def batch_size(self) -> int:
        return self.top_ks.shape[0]

    def _update_flags(self) -> None:
        """Recompute the fast-path flags; called whenever the row set changes."""
        sampled = self.top_ks != 1  # [bs], greedy rows never need masking
        self.is_all_greedy = not bool(sampled.any())
        self.need_top_k = bool((sampled & (self.top_ks < self.vocab_size)).any())
        self.need_top_p = bool((sampled & (self.top_ps < 1.0)).any())
        self.need_min_p = bool((sampled & (self.min_ps > 0.0)).any())
        if self.seeds is not None and not bool((self.seeds >= 0).any()):
            self.seeds = None

    # ------------------------------------------------------------------ batch bookkeeping
    def filter(self, keep_indices: list[int]) -> None:
        """Keep only rows `keep_indices` (in that order)."""
        keep = torch.tensor(keep_indices, dtype=torch.int64, device=self.device)  # [k]
        if self.vocab_mask is not None:
            self.vocab_mask = self.vocab_mask.filter(keep, self.batch_size)
        self.temperatures = self.temperatures.index_select(0, keep)
        self.top_ps = self.top_ps.index_select(0, keep)
        self.top_ks = self.top_ks.index_select(0, keep)
        self.min_ps = self.min_ps.index_select(0, keep)
        if self.seeds is not None:
            self.seeds = self.seeds.index_select(0, keep)
        if self.penalizer is not None:
            self.penalizer = self.penalizer.filter(keep, keep_indices)
        if self.custom is not None:
            self.custom = self.custom.filter(keep_indices)
        self._update_flags()

    def merge(self, other: SamplingBatchInfo) -> None:
        """Append other's rows after self's."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge vocab sizes {self.vocab_size} and {other.vocab_size}")
        bs_a, bs_b = self.batch_size, other.batch_size
        self.penalizer = merge_optional(
            self.penalizer, other.penalizer, bs_a, bs_b, self.vocab_size, self.device
        )
        self.seeds = _cat_optional(self.seeds, other.seeds, bs_a, bs_b, -1)
        self.vocab_mask = VocabMask.merge(self.vocab_mask, other.vocab_mask, bs_a)
        self.custom = CustomRows.merge(self.custom, other.custom, bs_a, bs_b)
        self.temperatures = torch.cat([self.temperatures, other.temperatures])
        self.top_ps = torch.cat([self.top_ps, other.top_ps])
        self.top_ks = torch.cat([self.top_ks, other.top_ks])
        self.min_ps = torch.cat([self.min_ps, other.min_ps])
        self._update_flags()

    def sync_output_tokens(self, outputs: Sequence[Sequence[int]]) -> None:
        """Bring penalty / min_new_tokens state up to date with each row's output so far
        (`outputs[i]` = row i's request's output_ids); called right before sampling."""
        if self.penalizer is not None:
            self.penalizer.sync(outputs)

    def copy_for_forward(self) -> SamplingBatchInfo:
        """Shallow copy for an overlapped forward pass (filter/merge rebind, never mutate)."""
        return dataclasses.replace(self)


def _clamp_top_k(top_k: int, vocab_size: int) -> int:
    # -1 and the TOP_K_ALL sentinel both mean "whole vocab".
    return vocab_size if top_k < 0 or top_k >= vocab_size else int(top_k)


def _suppress_ids(req: Any, eos_token_ids: Sequence[int]) -> list[int]:
    """Token ids to forbid while the request is below min_new_tokens (empty when unused)."""
    params = req.sampling_params
    if params.min_new_tokens <= 0:
        return []
    ids = set(eos_token_ids)
    ids.update(getattr(req, "eos_token_ids", None) or ())
    ids.update(params.stop_token_ids or ())
    return sorted(ids)


def _cat_optional(
    a: Tensor | None, b: Tensor | None, bs_a: int, bs_b: int, fill: int | bool
) -> Tensor | None:
    """Concatenate rows where either side may be absent (absent = all rows hold `fill`)."""
    if a is None and b is None:
        return None
    ref = a if a is not None else b
    if a is None:
        a = torch.full((bs_a, *ref.shape[1:]), fill, dtype=ref.dtype, device=ref.device)
    if b is None:
        b = torch.full((bs_b, *ref.shape[1:]), fill, dtype=ref.dtype, device=ref.device)
    return torch.cat([a, b])
