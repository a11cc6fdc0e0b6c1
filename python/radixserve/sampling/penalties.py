"""Batched logit penalties: frequency, presence, repetition, logit_bias and min_new_tokens.

All state is dense per-batch tensors so applying penalties is a handful of tensor ops with no
per-request Python loop. Each piece of state exists only when some row of the batch needs it; a batch
where no row uses any penalty carries no `PenaltyState` at all (see `PenaltyState.from_reqs`).

Semantics (per row, `t` a token id):
  repetition (t in prompt or output): logit = logit / rp if logit > 0 else logit * rp
  frequency:                         logit -= fp * count_out[t]
  presence:                          logit -= pp * (count_out[t] > 0)
  logit_bias:                        logit += bias[t]
  min_new_tokens:                    logit = -inf for t in suppress_ids while len(output) < min_new
Repetition is applied first (it scales the raw logit, as HF does), then the additive penalties and
the bias, then the -inf suppression so nothing can lift a suppressed token back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from radixserve.multimodal.pad_values import without_pads


@dataclass
class PenaltyState:
    frequency_penalties: Tensor  # [bs, 1] fp32
    presence_penalties: Tensor  # [bs, 1] fp32
    repetition_penalties: Tensor  # [bs, 1] fp32
    min_new_tokens: Tensor  # [bs] int64
    output_lens: Tensor  # [bs] int64, tokens generated so far
    output_counts: Tensor | None  # [bs, vocab] fp32; only if a row has frequency/presence penalty
    seen_mask: Tensor | None  # [bs, vocab] bool, prompt ∪ output; only if a row has repetition
    suppress_mask: Tensor | None  # [bs, vocab] bool, eos ∪ stop ids; only if a row has min_new_tokens
    logit_bias: Tensor | None  # [bs, vocab] fp32; only if a row has a logit_bias
    vocab_size: int
    # Per row, how many of the request's output tokens the counts above include (host-side, so
    # `sync` finds the new ones without reading the device).
    counted: list[int]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_reqs(
        cls,
        reqs: Sequence[Any],
        vocab_size: int,
        device: str | torch.device,
        suppress_ids: Sequence[Sequence[int]],
    ) -> PenaltyState | None:
        """None when no request uses a penalty or min_new_tokens (the common, free case)."""
        params = [r.sampling_params for r in reqs]
        use_count = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_min = any(p.min_new_tokens > 0 and ids for p, ids in zip(params, suppress_ids))
        use_bias = any(p.logit_bias for p in params)
        if not (use_count or use_rep or use_min or use_bias):
            return None

        def col(name: str) -> Tensor:  # [bs, 1] fp32
            vals = [float(getattr(p, name)) for p in params]
            return torch.tensor(vals, dtype=torch.float32, device=device).unsqueeze(1)

        outputs = [list(r.output_ids) for r in reqs]
        bs = len(reqs)
        counts = seen = suppress = None
        if use_count:
            counts = _count_matrix(outputs, bs, vocab_size, device)
        if use_rep:
            seen = _membership_matrix(
                # Image tokens are pad values past the vocabulary (multimodal/inputs.py), no tokens.
                [without_pads(r.origin_input_ids) + o for r, o in zip(reqs, outputs)],
                bs,
                vocab_size,
                device,
            )
        if use_min:
            suppress = _membership_matrix(suppress_ids, bs, vocab_size, device)
        return cls(
            frequency_penalties=col("frequency_penalty"),
            presence_penalties=col("presence_penalty"),
            repetition_penalties=col("repetition_penalty"),
            min_new_tokens=torch.tensor([p.min_new_tokens for p in params], dtype=torch.int64, device=device),
            output_lens=torch.tensor([len(o) for o in outputs], dtype=torch.int64, device=device),
            output_counts=counts,
            seen_mask=seen,
            suppress_mask=suppress,
            logit_bias=_bias_matrix(params, vocab_size, device) if use_bias else None,
            vocab_size=vocab_size,
            counted=[len(o) for o in outputs],
        )

    @classmethod
    def neutral(cls, bs: int, vocab_size: int, device: str | torch.device) -> PenaltyState:
        """State for rows that use no penalty: lets a penalized batch merge with a plain one."""
        ones = torch.ones(bs, 1, dtype=torch.float32, device=device)
        zeros_i = torch.zeros(bs, dtype=torch.int64, device=device)
        return cls(
            frequency_penalties=torch.zeros_like(ones),
            presence_penalties=torch.zeros_like(ones),
            repetition_penalties=ones,
            min_new_tokens=zeros_i,
            output_lens=zeros_i.clone(),
            output_counts=None,
            seen_mask=None,
            suppress_mask=None,
            logit_bias=None,
            vocab_size=vocab_size,
            counted=[0] * bs,
        )

    @property
    def batch_size(self) -> int:
        return self.min_new_tokens.shape[0]

    # ------------------------------------------------------------------ hot path
    def apply(self, logits: Tensor) -> None:
        """Penalize logits [bs, vocab] fp32 in place."""
        if self.seen_mask is not None:
            rp = self.repetition_penalties  # [bs, 1]
            scaled = torch.where(logits < 0, logits * rp, logits / rp)
            logits.copy_(torch.where(self.seen_mask, scaled, logits))
        if self.output_counts is not None:
            counts = self.output_counts  # [bs, vocab]
            logits.sub_(counts * self.frequency_penalties)
            logits.sub_((counts > 0).to(logits.dtype) * self.presence_penalties)
        if self.logit_bias is not None:
            logits.add_(self.logit_bias)
        if self.suppress_mask is not None:
            active = self.output_lens < self.min_new_tokens  # [bs]
            logits.masked_fill_(self.suppress_mask & active.unsqueeze(1), float("-inf"))

    def sync(self, outputs: Sequence[Sequence[int]]) -> None:
        """Count the output tokens of each row not counted yet (`outputs[i]`: row i's request's
        whole output so far, every id in [0, vocab)).

        The state follows the requests' output lists rather than each forward's sampled ids: it
        does not matter how many batches ran, or were filtered or merged, since the last call, so
        the overlap loop can build the next batch before the previous one's tokens are known and
        sync right before sampling it (delayed sampling), exactly like the normal loop.
        """
        rows: list[int] = []
        toks: list[int] = []
        for i, ids in enumerate(outputs):
            done = self.counted[i]
            if len(ids) > done:
                new = ids[done:]
                rows.extend([i] * len(new))
                toks.extend(new)
                self.counted[i] = len(ids)
        if not rows:
            return
        device = self.output_lens.device
        r = torch.tensor(rows, dtype=torch.int64, device=device)
        t = torch.tensor(toks, dtype=torch.int64, device=device)
        self.output_lens.index_add_(0, r, torch.ones_like(r))
        if self.output_counts is not None:
            self.output_counts.index_put_((r, t), torch.ones_like(t, dtype=torch.float32), accumulate=True)
        if self.seen_mask is not None:
            self.seen_mask.index_put_((r, t), torch.ones_like(t, dtype=torch.bool))

    # ------------------------------------------------------------------ batch bookkeeping
    def filter(self, keep: Tensor, keep_indices: Sequence[int]) -> PenaltyState | None:
        """New state with rows `keep` ([k] int64, the same rows as `keep_indices`); None when no
        kept row needs penalties.

        Returns a new object (never mutates) so a forward-time copy of the batch stays valid.
        """
        kept = replace(
            self,
            **{f: _index(getattr(self, f), keep) for f in _TENSOR_FIELDS},
            counted=[self.counted[i] for i in keep_indices],
        )
        return kept if kept._any_active() else None

    def merge(self, other: PenaltyState) -> PenaltyState:
        """New state: rows of self followed by rows of other."""
        assert self.vocab_size == other.vocab_size, "cannot merge batches of different vocab sizes"
        merged = {}
        for name in _TENSOR_FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            if a is None and b is None:
                merged[name] = None
                continue
            # A side without this state has only neutral rows for it: zeros / False are exact.
            a = a if a is not None else _zeros_like_rows(b, self.batch_size)
            b = b if b is not None else _zeros_like_rows(a, other.batch_size)
            merged[name] = torch.cat([a, b], dim=0)
        return replace(self, **merged, counted=self.counted + other.counted)

    def _any_active(self) -> bool:
        if self.output_counts is not None and bool(
            (self.frequency_penalties != 0).any() or (self.presence_penalties != 0).any()
        ):
            return True
        if self.seen_mask is not None and bool((self.repetition_penalties != 1).any()):
            return True
        if self.logit_bias is not None and bool((self.logit_bias != 0).any()):
            return True
        return self.suppress_mask is not None and bool((self.min_new_tokens > 0).any())


_TENSOR_FIELDS = tuple(f.name for f in fields(PenaltyState) if f.name not in ("vocab_size", "counted"))


def merge_optional(
    a: PenaltyState | None,
    b: PenaltyState | None,
    bs_a: int,
    bs_b: int,
    vocab_size: int,
    device: str | torch.device,
) -> PenaltyState | None:
    """Merge where either side may carry no state (None = all rows neutral)."""
    if a is None and b is None:
        return None
    a = a if a is not None else PenaltyState.neutral(bs_a, vocab_size, device)
    b = b if b is not None else PenaltyState.neutral(bs_b, vocab_size, device)
    return a.merge(b)


def _index(t: Tensor | None, keep: Tensor) -> Tensor | None:
    return None if t is None else t.index_select(0, keep.to(t.device))


def _zeros_like_rows(t: Tensor, rows: int) -> Tensor:
    return torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)


def _flat_indices(
    rows: Sequence[Sequence[int]], vocab_size: int, device: str | torch.device
) -> tuple[Tensor, Tensor]:
    """(row index, token id) pairs of a ragged list, as two flat int64 tensors."""
    row_idx = [i for i, ids in enumerate(rows) for _ in ids]
    tok_idx = [int(t) for ids in rows for t in ids]
    if any(not 0 <= t < vocab_size for t in tok_idx):
        raise ValueError(f"token id outside the vocabulary [0, {vocab_size})")
    return (
        torch.tensor(row_idx, dtype=torch.int64, device=device),
        torch.tensor(tok_idx, dtype=torch.int64, device=device),
    )


def _count_matrix(
    rows: Sequence[Sequence[int]], bs: int, vocab_size: int, device: str | torch.device
) -> Tensor:
    """[bs, vocab] fp32 occurrence counts (fp32 so the hot path multiplies without a cast)."""
    counts = torch.zeros(bs, vocab_size, dtype=torch.float32, device=device)
    r, t = _flat_indices(rows, vocab_size, device)
    counts.index_put_((r, t), torch.ones_like(t, dtype=torch.float32), accumulate=True)
    return counts


def _bias_matrix(params: Sequence[Any], vocab_size: int, device: str | torch.device) -> Tensor:
    """[bs, vocab] fp32: each row's logit_bias (verified: ids in the vocabulary), zeros elsewhere."""
    bias = torch.zeros(len(params), vocab_size, dtype=torch.float32)
    for row, p in enumerate(params):
        for token, value in (p.logit_bias or {}).items():
            bias[row, int(token)] = value
    return bias.to(device)


def _membership_matrix(
    rows: Sequence[Sequence[int]], bs: int, vocab_size: int, device: str | torch.device
) -> Tensor:
    """[bs, vocab] bool, True where the token occurs in the row's list."""
    mask = torch.zeros(bs, vocab_size, dtype=torch.bool, device=device)
    r, t = _flat_indices(rows, vocab_size, device)
    mask[r, t] = True
    return mask
