"""The batched LoRA delta: out[t] += (x[t] @ A[s_t]^T) @ B[s_t]^T for every token row t whose
adapter slot s_t >= 0 (rows of the base model, slot -1, get nothing).

Two implementations of the same contract:

- `lora_delta_reference`: torch-native, one gathered batched matmul over every adapted row
  (BGMV-style: each row reads its own slot's matrices). Simple and obviously right; its gather
  copies rank x in_features values per row, so it is the reference, not the fast path.
- `lora_delta_segmented`: SGMV-style. `LoRASegments` (built once per forward, shared by every
  layer) sorts the adapted rows by slot; each projection gathers its input rows once, runs two
  dense GEMMs per slot present (at most --max-loras-per-batch, never a loop over requests) and
  scatters the delta back once. Rows already in slot order (a prefill) are a slice, not a gather.

A dense path (`lora_delta_dense`) serves small batches over several adapters. On CPU, when
sgl-kernel's extension is built, `lora_delta` runs its compiled kernel (`sgl_kernel.cpu.lora_delta_`,
csrc/cpu/lora.cpp): one call per projection that sorts the rows by slot and fuses the shrink and
the expand. `lora_delta` picks.
Layouts: a [slots, rank, in], b [slots, rank, out] (so both view as 2-D matrices over all slots).
B holds the adapter's scaling already (lora/adapter.py), and a slot's rank is padded with zeros
to the pool's rank, which adds exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

try:
    from sgl_kernel import cpu as _cpu_kernels
except ImportError:  # sgl-kernel not installed: the torch paths below
    _cpu_kernels = None  # type: ignore[assignment]

# The compiled kernel is built (decided once; RADIXSERVE_DISABLE_CPU_KERNELS=1 turns it off).
# It takes every batch shape on CPU, by measurement (`bench_cpu_kernels.py --only lora`, AMD EPYC
# Zen 1 (AVX2), one thread, a busy shared machine, rank 16, 8 slots, us per call, compiled /
# dense / segmented): decode 16 rows over 8 adapters, 576->1536: 662 / 2357 / 1911; 64 rows over 8:
# 1563 / 6974 / 3207; 64 rows of one adapter: 1362 / 10101 / 1942; prefill 512 rows of one,
# 1536->576: 17596 / 69588 / 16025 (within noise; 576->1536: 12734 / - / 18908).
COMPILED = _cpu_kernels is not None and _cpu_kernels.lora_delta_available()
_COMPILED_DTYPES = (torch.float32, torch.bfloat16)

# A batch of at most this many rows x slots takes the dense path: every slot's shrink in one GEMM,
# the rows' own blocks kept by a mask, one expand GEMM (4 ops per projection whatever the number
# of adapters, where the segmented path runs 2 per adapter: a decode step's small GEMMs are bound
# by per-op overhead, not FLOPs). 256 = 32 decode rows with 8 slots.
DENSE_MAX_ROWS_X_SLOTS = 256


@dataclass(frozen=True)
class LoRASegments:
    """A forward's adapted token rows sorted by slot, built once and read by every projection.

    `rows` lists the adapted rows in slot order (a slice when that is already their order, as for
    a prefill of one request); `segments` are (slot, start, end) ranges of that order. Each
    projection gathers x once, runs two GEMMs per slot over contiguous rows, and scatters once.
    """

    token_slots: torch.Tensor  # [num_tokens] int64, -1 = base
    rows: torch.Tensor | slice  # [num_adapted] row indices, sorted by slot
    num_rows: int
    segments: tuple[tuple[int, int, int], ...]  # (slot, start, end) into `rows`
    _masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict, compare=False)

    @classmethod
    def build(cls, token_slots: torch.Tensor) -> LoRASegments | None:
        """None when no row is adapted (the hooks then do nothing)."""
        adapted = (token_slots >= 0).nonzero().flatten()  # [m]
        if adapted.numel() == 0:
            return None
        slots = token_slots[adapted]
        order = torch.sort(slots, stable=True).indices
        rows = adapted[order]  # [m]
        present, counts = torch.unique_consecutive(slots[order], return_counts=True)
        bounds = [0, *torch.cumsum(counts, 0).tolist()]
        segments = tuple((int(s), bounds[i], bounds[i + 1]) for i, s in enumerate(present.tolist()))
        first, m = int(rows[0]), rows.numel()
        in_order = bool((rows == torch.arange(first, first + m, device=rows.device)).all())
        return cls(token_slots, slice(first, first + m) if in_order else rows, m, segments)

    def dense_mask(self, num_slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_tokens, num_slots * rank]: 1 on each row's own slot's rank block, else 0."""
        key = (num_slots, rank, dtype)
        if key not in self._masks:
            col_slot = torch.arange(num_slots, device=self.token_slots.device).repeat_interleave(rank)
            self._masks[key] = (self.token_slots[:, None] == col_slot[None, :]).to(dtype)
        return self._masks[key]


def lora_delta_reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor
) -> None:
    """x [n, in], a [slots, rank, in], b [slots, rank, out], token_slots [n]; adds into out [n, out]."""
    rows = (token_slots >= 0).nonzero().flatten()  # [m]
    if rows.numel() == 0:
        return
    slots = token_slots[rows]
    xa = torch.bmm(a[slots], x[rows].unsqueeze(-1))  # [m, rank, 1]
    delta = torch.bmm(xa.transpose(1, 2), b[slots]).squeeze(1)  # [m, out]
    out.index_add_(0, rows, delta.to(out.dtype))


def compiled_kernel_selected(x: torch.Tensor) -> bool:
    """Whether `lora_delta` runs sgl-kernel's compiled kernel for activations like x."""
    return COMPILED and x.device.type == "cpu" and x.dtype in _COMPILED_DTYPES


def lora_delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: LoRASegments, out: torch.Tensor
) -> None:
    """The fast path: the compiled kernel on CPU; else dense for small batches over several
    adapters, segmented otherwise."""
    if (
        compiled_kernel_selected(x)
        and out.dtype == x.dtype
        and a.dtype in _COMPILED_DTYPES
        and x.stride(-1) == 1
        and out.stride(-1) == 1
    ):
        _cpu_kernels.lora_delta_(x, a, b, segments.token_slots, out)
        return
    num_slots = a.shape[0]
    if len(segments.segments) > 1 and x.shape[0] * num_slots <= DENSE_MAX_ROWS_X_SLOTS:
        lora_delta_dense(x, a, b, segments, out)
    else:
        lora_delta_segmented(x, a, b, segments, out)


def lora_delta_dense(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: LoRASegments, out: torch.Tensor
) -> None:
    """Every slot's shrink at once, each row keeps its own slot's block, one expand: base rows'
    mask is all zeros, so they get exact zeros."""
    num_slots, rank, d_in = a.shape
    xa = x @ a.view(num_slots * rank, d_in).t()  # [n, slots * rank]
    xa.mul_(segments.dense_mask(num_slots, rank, xa.dtype))
    out += xa @ b.view(num_slots * rank, b.shape[2])  # [n, out]


def lora_delta_segmented(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: LoRASegments, out: torch.Tensor
) -> None:
    """The same as lora_delta_reference: one gather, two GEMMs per slot present, one scatter."""
    rows = segments.rows
    xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)  # [m, in], slot order
    if len(segments.segments) == 1:
        slot = segments.segments[0][0]
        delta = (xs @ a[slot].t()) @ b[slot]  # [m, out]
    else:
        delta = torch.empty(segments.num_rows, b.shape[2], dtype=x.dtype, device=x.device)
        for slot, start, end in segments.segments:
            torch.matmul(xs[start:end] @ a[slot].t(), b[slot], out=delta[start:end])
    if isinstance(rows, slice):
        out[rows] += delta
    else:
        out.index_add_(0, rows, delta)
