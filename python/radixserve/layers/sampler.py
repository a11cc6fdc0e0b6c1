"""Token sampler: penalties, grammar mask, temperature, top-k/top-p/min-p, seeded sampling.

Order per call:
  1. logprobs = log_softmax(raw logits) when asked (the user-visible distribution is the model's);
  2. penalties + min_new_tokens, then the grammar vocab mask (-inf where disallowed);
  3. all-greedy batch: argmax; otherwise temperature -> softmax -> one (partial) sort per batch
     giving each row's smallest kept probability under top-k / top-p / min-p -> zero the rest ->
     inverse-CDF draw with one uniform per row;
  4. rows with top_k == 1 take the argmax whatever the rest of the batch does.

Seeded rows take their uniform from a hash of (seed, position), so the sampled token depends only
on that row's logits, seed and position — not on batch size, row order or torch's RNG. Unseeded rows
draw from the sampler's own generator (seeded with --random-seed), so every tensor-parallel rank,
given the same gathered logits, draws the same tokens. The sort is usually a topk prefix: top-k and min-p cuts lie inside the largest
top-k, and a top-p cut without top-k is first looked for in the top 1024 (full sort as fallback),
which matters on CPU where sorting a 150k vocab costs ~1 s per 32 rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from radixserve.layers.cpu_fused import cpu_kernels
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo

# sgl-kernel's argmax_rows: torch.argmax's indices ~10x faster on CPU (torch's walks the row one
# element at a time: 0.2-0.4 ms a 152k-token row, several ms a step for 64 rows). Decided once.
# An older sgl_kernel on PYTHONPATH (as A/B runs put one) has none.
_ARGMAX_KERNEL = getattr(cpu_kernels, "argmax_rows_available", lambda: False)()
_CHECKED_KERNEL = getattr(cpu_kernels, "argmax_rows_checked_available", lambda: False)()


@dataclass
class SampleOutput:
    next_token_ids: Tensor  # [bs] int64, always in [0, vocab)
    next_token_logprobs: Tensor | None  # [bs] fp32, logprob of the chosen token (raw distribution)
    top_logprobs_val: list[list[float]] | None  # per row, top_logprobs_nums[i] values
    top_logprobs_idx: list[list[int]] | None  # per row, matching token ids
    # [bs] bool: rows with no valid draw (NaN logits, nothing allowed, an id outside the vocab);
    # their next_token_ids hold a placeholder in range, never to be kept (see _guard).
    invalid_rows: Tensor | None = None
    # token_ids_logprob: per row, the logprob of each requested id ([] for rows without); or None.
    token_ids_logprobs_val: list[list[float]] | None = None


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(
        self,
        logits: Tensor,
        info: SamplingBatchInfo,
        positions: Tensor,
        return_logprob: bool,
        top_logprobs_nums: list[int] | None,
        token_ids_logprobs: list[tuple[int, ...] | None] | None = None,
    ) -> SampleOutput:
        """logits [bs, vocab] raw; positions [bs] int64 = position of the token being sampled."""
        if logits.dtype != torch.float32:  # each call here is a torch op: see greedy_checked
            logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if return_logprob else None  # [bs, vocab]
        logits = _constrain(logits, info)
        if info.is_all_greedy:
            next_ids, invalid = greedy_checked(logits)
        else:
            next_ids, drawn = _sample(logits, info, positions, self.generator)
            next_ids, invalid = _guard(next_ids, logits, drawn)
        if raw_logprobs is None:
            return SampleOutput(next_ids, None, None, None, invalid)
        chosen = raw_logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)  # [bs]
        top_val, top_idx = _top_logprobs(raw_logprobs, top_logprobs_nums)
        tid_val = gather_token_ids(raw_logprobs, token_ids_logprobs)
        return SampleOutput(next_ids, chosen, top_val, top_idx, invalid, tid_val)


def argmax(logits: Tensor) -> Tensor:
    """logits.argmax(dim=-1) of [bs, vocab] logits: the same indices (the first of each row's
    maximum, a NaN the greatest), from sgl-kernel's vectorized loop where it applies."""
    if _ARGMAX_KERNEL and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        if logits.shape[1] > 0 and logits.stride(1) == 1:
            return cpu_kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def greedy_checked(logits: Tensor) -> tuple[Tensor, Tensor]:
    """_guard(argmax(logits), logits, None) for [bs, vocab] fp32 logits: the argmax and whether
    its logit is not finite. On CPU one sgl-kernel call: right after a forward (which streamed the
    weights through the caches) every small torch op runs cold, and the torch guard is eleven of
    them (benchmark/bench_cold_ops.py on Zen 3: 449 us cold against 97 for this call;
    docs/cpu_backend.md, "Host work around a step")."""
    if _CHECKED_KERNEL and logits.is_cpu:  # the kernel takes any layout (and refuses empty rows)
        return cpu_kernels.argmax_rows_checked(logits)
    return _guard(argmax(logits), logits, None)


def _guard(next_ids: Tensor, logits: Tensor, drawn: Tensor | None) -> tuple[Tensor, Tensor]:
    """([bs] ids all in [0, vocab), [bs] bool invalid): a row is invalid when its id is outside the
    vocabulary, its chosen (constrained) logit is not finite (a NaN row, or every token masked), or
    its inverse-CDF draw had no finite positive mass (`drawn` False). Invalid rows get id 0: an id
    out of range would crash the embedding of the next forward, which may already reference it.
    O(bs): no pass over the vocabulary."""
    vocab = logits.shape[1]
    in_range = (next_ids >= 0) & (next_ids < vocab)
    safe = torch.where(in_range, next_ids, torch.zeros_like(next_ids))
    chosen = logits.gather(1, safe.unsqueeze(1)).squeeze(1)  # [bs]
    invalid = ~in_range | ~torch.isfinite(chosen)
    if drawn is not None:
        invalid |= ~drawn
    return safe, invalid


# 1e30 / GREEDY_EPS (1e-6) = 1e36 < float32's max (3.4e38).
_LOGIT_MAX = 1e30


def _constrain(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """Penalties, min_new_tokens, grammar mask and custom processors (in SGLang's order), on a
    copy so the caller's logits stay raw."""
    if info.penalizer is None and info.vocab_mask is None and info.custom is None:
        return logits
    logits = logits.clone()
    if info.penalizer is not None:
        info.penalizer.apply(logits)
        # An extreme but valid penalty (repetition_penalty 1e-30) can push a logit to +inf, and
        # +inf turns softmax into NaN. Capped at _LOGIT_MAX, it stays finite even divided by the
        # smallest sampled temperature (GREEDY_EPS); -inf (suppressed tokens) is kept.
        logits.clamp_(max=_LOGIT_MAX)
    if info.vocab_mask is not None:
        info.vocab_mask.apply_(logits)  # touches the constrained rows only
    if info.custom is not None:
        info.custom.apply(logits)
    return logits


def _sample(
    logits: Tensor, info: SamplingBatchInfo, positions: Tensor, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """[bs, vocab] constrained logits -> ([bs] int64 token ids, [bs] bool: the draw had mass)."""
    probs = _cut_probs(logits, info)  # [bs, vocab]
    next_ids, drawn = _inverse_cdf(probs, _uniforms(info.seeds, positions, probs, generator))
    greedy_rows = info.top_ks == 1  # [bs]
    if bool(greedy_rows.any()):
        next_ids = torch.where(greedy_rows, argmax(logits), next_ids)
        drawn = drawn | greedy_rows  # greedy rows are judged by their chosen logit (_guard)
    return next_ids, drawn


def target_probs(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """[n, vocab] logits -> the distribution `_sample` draws from (temperature, then the top-k /
    top-p / min-p cuts), normalized; one SamplingBatchInfo row per logits row, no greedy rows."""
    probs = _cut_probs(logits.float(), info)  # [n, vocab]
    return probs / probs.sum(dim=-1, keepdim=True)


def _cut_probs(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """[bs, vocab] fp32 logits -> softmax at each row's temperature with the tokens below the row's
    top-k / top-p / min-p threshold zeroed (zeros never win the inverse-CDF draw)."""
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    if info.need_top_k or info.need_top_p or info.need_min_p:
        probs = probs.masked_fill(probs < _keep_thresholds(probs, info), 0.0)
    return probs


def draw(weights: Tensor, u: Tensor) -> Tensor:
    """One token per row from unnormalized weights [n, vocab] with uniforms u [n] (inverse CDF in
    token-id order, as the sampler draws). Rows need positive finite mass (speculative
    verification draws only from the target's own distribution or a residual of it)."""
    return _inverse_cdf(weights, u)[0]


def _keep_thresholds(probs: Tensor, info: SamplingBatchInfo) -> Tensor:
    """[bs, 1] smallest kept probability per row after top-k, then top-p, then min-p.

    Only the *values* of the sorted probabilities are used, never the order of tied tokens, so the
    kept set (and a seeded draw) does not depend on how a sort breaks ties. Tokens tied with the
    last kept one are kept too (as HF's TopKLogitsWarper does).
    """
    vocab = probs.shape[1]
    sampled = info.top_ks > 1  # [bs]; greedy rows are overwritten by argmax later
    limited = sampled & (info.top_ks < vocab)  # [bs]; rows with a real top-k cut
    # Every top-k / min-p cut lies inside the largest top-k prefix (min-p needs only the max).
    width = int(info.top_ks[limited].max()) if info.need_top_k else 1
    if bool((sampled & ~limited & (info.top_ps < 1.0)).any()):
        # top-p without top-k: its cut usually lies well inside a short prefix; try that first.
        width = max(width, _TOP_P_PREFIX)
    if width < vocab:
        thresholds = _prefix_thresholds(torch.topk(probs, width, dim=-1).values, probs, info)
        if thresholds is not None:
            return thresholds
    return _prefix_thresholds(torch.sort(probs, dim=-1, descending=True).values, probs, info)


# Prefix length tried for top-p rows without top-k before falling back to a full sort, which on a
# CPU costs ~50x a topk of this size for a 150k vocab.
_TOP_P_PREFIX = 1024


def _prefix_thresholds(sorted_p: Tensor, probs: Tensor, info: SamplingBatchInfo) -> Tensor | None:
    """Thresholds from the `width` largest probabilities per row (sorted_p [bs, width], descending).

    None when some top-p cut would fall beyond the prefix (only possible if width < vocab).
    """
    vocab = probs.shape[1]
    width = sorted_p.shape[1]
    limited = info.top_ks < vocab  # [bs]
    ranks = torch.arange(width, device=probs.device).unsqueeze(0)  # [1, width]
    keep = ranks < info.top_ks.unsqueeze(1)  # [bs, width], a prefix per row
    top_ps = info.top_ps.unsqueeze(1)  # [bs, 1]
    if info.need_top_p:
        # top-p applies to the distribution left by top-k (HF warper order): total is the top-k
        # mass for limited rows (all inside the prefix) and the whole row's mass otherwise.
        kept_p = sorted_p * keep
        cum = kept_p.cumsum(dim=-1)
        exclusive = cum - kept_p  # mass strictly before each rank
        total = torch.where(limited.unsqueeze(1), cum[:, -1:], probs.sum(dim=-1, keepdim=True))
        # Smallest prefix whose mass reaches top_p; rows with top_p == 1 skip the test so fp
        # rounding in the cumsum can never drop a token there.
        keep &= (exclusive < top_ps * total) | (top_ps >= 1.0)
        prefix_too_short = keep[:, -1] & ~limited & (info.top_ps < 1.0) & (info.top_ks > 1)
        if width < vocab and bool(prefix_too_short.any()):
            return None
    count = keep.sum(dim=-1, keepdim=True).clamp_min(1)  # [bs, 1]; rank 0 is always kept
    thresholds = sorted_p.gather(1, count - 1)
    # Rows with neither a top-k nor a top-p cut keep everything (their prefix may exceed width).
    uncut = ~limited.unsqueeze(1) & (top_ps >= 1.0)
    thresholds = thresholds.masked_fill(uncut, 0.0)
    if info.need_min_p:
        # Relative to the max, so renormalization by the earlier cuts does not change it.
        thresholds = torch.maximum(thresholds, info.min_ps.unsqueeze(1) * sorted_p[:, :1])
    return thresholds


def _inverse_cdf(weights: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Sample one token per row from unnormalized weights [bs, vocab] with uniforms u [bs];
    returns ([bs] ids, [bs] bool: the row had finite positive mass, so its id is a real draw).

    Token-id order (not sorted order) keeps the draw independent of sort tie-breaking. The chosen
    index i satisfies cum[i] > cum[i-1], so a zero-weight token can never be drawn.
    """
    cum = weights.cumsum(dim=-1)  # [bs, vocab], non-decreasing
    total = cum[:, -1:].contiguous()  # [bs, 1]
    ids = torch.searchsorted(cum, u.unsqueeze(1) * total, right=True)
    # u * total can round up to total; the last index where cum rises is the last positive token.
    last = torch.searchsorted(cum, total, right=False)
    total = total.squeeze(1)
    return torch.minimum(ids, last).squeeze(1), torch.isfinite(total) & (total > 0)


def _uniforms(seeds: Tensor | None, positions: Tensor, like: Tensor, generator: torch.Generator) -> Tensor:
    """[bs] fp32 in (0, 1): hash(seed, position) for seeded rows, the generator for the others."""
    u = torch.rand(like.shape[0], dtype=torch.float32, device=like.device, generator=generator)
    if seeds is None:
        return u
    seeds = seeds.to(like.device)
    pos = positions.to(like.device, torch.int64)
    return torch.where(seeds >= 0, hashed_uniform(seeds, pos), u)


# ---------------------------------------------------------------------- counter-based noise
_MASK64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift on int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: Tensor) -> Tensor:
    """splitmix64 finalizer on int64 bits; multiplication wraps mod 2**64 like uint64."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def hashed_uniform(seeds: Tensor, positions: Tensor) -> Tensor:
    """fp32 in (0, 1), a pure function of (seed, position), elementwise over int64 tensors."""
    h = _mix64(_mix64(seeds * _GOLDEN + _MIX1) + _mix64(positions + _GOLDEN))
    # Top 24 bits -> exactly representable in fp32; +0.5 keeps u strictly inside (0, 1).
    return (_shr(h, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _top_logprobs(
    logprobs: Tensor, nums: list[int] | None
) -> tuple[list[list[float]] | None, list[list[int]] | None]:
    """Per-row top-`nums[i]` (value, token id) lists from logprobs [bs, vocab]; one topk call."""
    if nums is None:
        return None, None
    k = min(max(nums, default=0), logprobs.shape[1])
    if k <= 0:
        return [[] for _ in nums], [[] for _ in nums]
    vals, idx = logprobs.topk(k, dim=-1)  # [bs, k], sorted descending
    vals_l, idx_l = vals.tolist(), idx.tolist()
    return [v[:n] for v, n in zip(vals_l, nums)], [i[:n] for i, n in zip(idx_l, nums)]


def gather_token_ids(
    logprobs: Tensor, token_ids: list[tuple[int, ...] | None] | None
) -> list[list[float]] | None:
    """Per row of logprobs [rows, vocab], the logprobs of that row's requested ids (token_ids_logprob;
    [] for a row with None), in the requested order; None when no row asked."""
    if token_ids is None:
        return None
    rows = [i for i, ids in enumerate(token_ids) if ids is not None]
    if not rows:
        return [[] for _ in token_ids]
    width = max(len(token_ids[i] or ()) for i in rows)
    # One padded gather (pad id 0, cut off below) and one copy to the host for the whole batch.
    padded = [list(token_ids[i] or ()) + [0] * (width - len(token_ids[i] or ())) for i in rows]
    index = torch.tensor(padded, dtype=torch.int64, device=logprobs.device)
    picked = logprobs[torch.tensor(rows, device=logprobs.device)].gather(1, index).tolist()
    out: list[list[float]] = [[] for _ in token_ids]
    for i, vals in zip(rows, picked):
        out[i] = vals[: len(token_ids[i] or ())]
    return out
