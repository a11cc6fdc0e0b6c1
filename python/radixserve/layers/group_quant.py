"""Weight-only group-quantized linear weights ("wq"): one representation for GGUF Q8_0 / Q4_0 /
Q4_1 / Q4_K / Q6_K tensors, GPTQ / AWQ int4 and on-the-fly int8 / int4 weight-only quantization.

Every one of those formats dequantizes a group of `group_size` consecutive inputs of one output
channel as w = q * scale (+ offset), with q an integer of at most 8 bits, so one type and one
kernel serve them all. The loaders map each format onto it exactly (docs/quantization.md lists
the mapping); `dequantize` repeats the formats' own fp32 arithmetic (a product, then a sum), so a
dequantized GGUF tensor has the same bits as gguf-py's reference dequantization.

On CUDA tensors linear_wq runs sgl-kernel's Triton dequant-GEMM (bits 4 and 8, any group size,
fp32/bf16/fp16 activations, fp32 accumulation), imported only when first needed; it is checked
under Triton's CPU interpreter, not on a GPU.

On CPU activations stay fp32: the kernel widens each group's q to fp32 in registers and accumulates in
fp32, so the result differs from the dequantize-then-matmul reference only in summation order.
The exception is a form marked `int8_activations` in a product of at most the installed
`wq_a8_max_tokens` rows (layers/cpu_crossovers.py: 0 unless this machine measured it faster or
--cpu-wq-int8-activations asked): its activations are quantized to int8 per 32 inputs first;
and such a form's batches above wq_max_tokens where this CPU chose int8-activation batch GEMMs
(Crossovers.wq_batch_a8: the panels' GEMM tiles, a8_batch). wq_kernel states the whole rule.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.layers.cpu_crossovers import active as crossovers
from radixserve.layers.cpu_fused import cpu_kernels

# sgl-kernel's linear_wq is built: decided once, like quantization.INT8_KERNEL.
WQ_KERNEL = (
    cpu_kernels is not None
    and cpu_kernels.available()
    and hasattr(getattr(cpu_kernels, "_ext", None), "linear_wq")
)

# sgl-kernel's linear_wq_a8 (int8 activations) is built.
WQ_A8_KERNEL = WQ_KERNEL and hasattr(getattr(cpu_kernels, "_ext", None), "linear_wq_a8")
# ... and its AVX2 panel kernel on weights repacked at load (GroupQuantWeight.a8_packed).
WQ_A8_PACKED = WQ_A8_KERNEL and cpu_kernels.linear_wq_a8_packed_available()
ACT_BLOCK = 32  # inputs per int8 activation scale (llama.cpp's Q8_0 block)
# --cpu-wq-int8-activations on a machine whose tuning did not measure the int8-activation bound:
# int8 activations up to this many rows. From ~3 rows on linear_wq_a8 was no faster than linear_wq
# on an AVX2 Zen 1 (the weight conversion it saves is shared by the rows there; ad-hoc timing on a
# shared machine, docs/quantization.md). Elsewhere the installed crossovers' wq_a8_max_tokens rules.
A8_MAX_ROWS = 2
# ... and on the 8-row panels (GroupQuantWeight.a8_packed): at every row count. One weight load
# feeds up to 4 rows of x, so the panel kernel's cost per row stays flat as rows grow, and it beat
# linear_wq at every row count measured, 1-128 (Q4_0 ~2x, Q8_0 ~1.3x), and the fp32 GEMM a
# dequantized weight would take from 16 rows up (Q4_0 ~23 vs ~15 G weight-rows/s, Q8_0 ~15 vs
# ~15; thread CPU, benchmark/bench_wq_a8.py, docs/quantization.md). So a form with panels is read
# through them for decode steps and prefills alike, and needs no fp32 form beside it.
A8_PACKED_MAX_ROWS = sys.maxsize


@dataclass(frozen=True)
class GroupQuantWeight:
    """A linear weight [N out, K in] as integers with a scale (and an offset) per group of inputs.

    qweight: bits 8: int8 [N, K]; bits 4: uint8 [N, K // 2], byte j of row n holding input 2j in
    its low nibble and input 2j + 1 in its high nibble (values 0..15).
    scales, offsets: fp32 [N, K // group_size]; offsets None means w = q * scale.
    kernel_form: an optional layout private to the kernel (made once, when loaded).
    int8_activations: the form may quantize x to int8 per block of 32 inputs before the product
    (llama.cpp's Q8_0 activations), which it does in products of at most the installed
    crossovers' wq_a8_max_tokens rows (0 by default): faster on CPUs without fast fp32
    dequantization, no longer the fp32 weight's exact product (linear_wq_a8_reference is its
    reference). Set on GGUF and torchao forms whose groups allow it (weight_only_forms.py).
    a8_packed: the same integers and scales repacked for linear_wq_a8's AVX2 panel kernel
    (sgl_kernel.cpu.pack_wq_a8; with_int8_activations(panels=True) makes it: one more copy of them
    in memory, so only under --cpu-wq-int8-activations or where this CPU's tuning chose panels for
    the batches or the small products; at the file's bytes, fp16 scales and Q4_0's offsets formed
    from them), or None.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    bits: int
    kernel_form: Any = None
    int8_activations: bool = False
    a8_packed: Any = None

    def __post_init__(self) -> None:
        n, k = self.out_features, self.in_features
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if k % self.group_size or self.group_size % 16:
            raise ValueError(
                f"group_size {self.group_size} must be a multiple of 16 dividing in_features {k}"
            )
        if self.int8_activations and self.group_size % ACT_BLOCK:
            raise ValueError(f"int8 activations need a group size that is a multiple of {ACT_BLOCK}")
        expected_dtype = torch.int8 if self.bits == 8 else torch.uint8
        if self.qweight.dtype != expected_dtype:
            raise ValueError(f"{self.bits}-bit qweight must be {expected_dtype}, got {self.qweight.dtype}")
        groups = (n, k // self.group_size)
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if t is not None and (tuple(t.shape) != groups or t.dtype != torch.float32):
                raise ValueError(f"{name} must be fp32 {list(groups)}, got {t.dtype} {list(t.shape)}")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    def nbytes(self) -> int:
        """Bytes a step reads: the integers, the scales and the offsets."""
        extra = 0 if self.offsets is None else self.offsets.numel() * 4
        return self.qweight.numel() + self.scales.numel() * 4 + extra

    def integers(self) -> torch.Tensor:
        """q as int32 [N, K] (4-bit values unpacked, low nibble first)."""
        if self.bits == 8:
            return self.qweight.to(torch.int32)
        low = (self.qweight & 0x0F).to(torch.int32)
        high = (self.qweight >> 4).to(torch.int32)
        return torch.stack((low, high), dim=-1).reshape(self.out_features, self.in_features)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [N, K]: q * scale, then + offset (the formats' own two fp32 roundings), written
        into `out` (a contiguous fp32 [N, K] buffer, reused by the caller) when given.

        The integers go straight to fp32 and the scales broadcast over [N, groups, group_size]:
        the same products and sums as expanding them per input, ~50x faster for 4-bit weights
        (every GGUF layer is dequantized once at start to check it against its fp32 weight)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        if out is None:
            out = torch.empty(n, k, dtype=torch.float32, device=self.qweight.device)
        if self.bits == 8:
            out.copy_(self.qweight)  # a TP shard is a view: copy_ reads it strided
        else:
            pairs = out.view(n, k // 2, 2)
            pairs[..., 0] = self.qweight & 0x0F  # input 2j: the low nibble
            pairs[..., 1] = self.qweight >> 4
        w = out.view(n, k // g, g)
        w.mul_(self.scales.unsqueeze(-1))
        if self.offsets is not None:
            w += self.offsets.unsqueeze(-1)
        return out


def with_int8_activations(w: GroupQuantWeight, panels: bool = False) -> GroupQuantWeight:
    """w marked for int8 activations; with `panels`, also repacked for the AVX2 panel kernel where
    it is built (one more copy of the integers and scales: memory traded for speed, so the caller
    asks for it: --cpu-wq-int8-activations)."""
    packed = None
    if panels and WQ_A8_PACKED and w.qweight.device.type == "cpu":
        packed = cpu_kernels.pack_wq_a8(w.qweight, w.scales, w.offsets, w.bits, w.group_size)
    return dataclasses.replace(w, int8_activations=True, a8_packed=packed)


def a8_rows(w: GroupQuantWeight) -> int:
    """Products of up to this many rows take int8 activations (wq_kernel has the whole rule): 0
    for an unmarked form; every product (A8_PACKED_MAX_ROWS) on panels that serve every row
    (panels_serve_every_row); else the installed crossovers' wq_a8_max_tokens (0: none)."""
    if not w.int8_activations:
        return 0
    return A8_PACKED_MAX_ROWS if panels_serve_every_row(w) else crossovers().wq_a8_max_tokens


def panels_serve_every_row(w: GroupQuantWeight) -> bool:
    """Whether w's panels serve every product: panels made for the whole form
    (--cpu-wq-int8-activations, or a MoE's experts) rather than for one kind of product. The
    crossovers say which: panels made for the batches (wq_batch_a8) or for the small products only
    (wq_a8_small_panels) leave the other products to their own choice."""
    bound = crossovers()
    return has_panels(w) and not (bound.wq_batch_a8 or bound.wq_a8_small_panels)


def wq_kernel(w: GroupQuantWeight, rows: int) -> str:
    """The one rule mapping a product of `rows` rows over w (CPU) to its kernel, given the
    installed crossovers (A = wq_a8_max_tokens, W = wq_max_tokens): "a8" (linear_wq_a8, on the
    panels where w has them), "wq" (exact linear_wq) or "gemm" (the layer's oneDNN copy, or its
    fp32 weight):
    - unmarked form: "wq" up to W rows, "gemm" above;
    - panels serving every row (panels_serve_every_row): "a8" at every row count;
    - else "a8" up to A rows, "wq" up to W, then "a8" where the batches chose the panels
      (wq_batch_a8, a form with panels; up to wq_batch_a8_max_tokens rows where that bound is
      set), "gemm" otherwise (the panels made for the small products only, wq_a8_small_panels,
      and the batches above that bound keep the layer's oneDNN copy for these)."""
    if rows <= a8_rows(w):
        return "a8"
    if rows <= crossovers().wq_max_tokens:
        return "wq"
    return "a8" if a8_batch(w, rows) else "gemm"


def a8_batch(w: GroupQuantWeight, rows: int) -> bool:
    """Whether a product of `rows` rows is one of the batches (above wq_max_tokens, and at most
    wq_batch_a8_max_tokens where set) that a form with panels runs on int8 activations because
    this CPU chose that (Crossovers.wq_batch_a8)."""
    bound = crossovers()
    upto = bound.wq_batch_a8_max_tokens
    return bound.wq_batch_a8 and has_panels(w) and bound.wq_max_tokens < rows and (not upto or rows <= upto)


def takes_int8_activations(w: GroupQuantWeight, rows: int) -> bool:
    """Whether linear_wq runs a product of `rows` rows of x on int8 activations (a8_rows for
    small products, a8_batch for the batches): what the greedy head asks before it proves an
    fp32-activation argmax the full head would not compute."""
    return rows <= a8_rows(w) or a8_batch(w, rows)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Integers 0..15 [N, K] (K even) -> uint8 [N, K // 2], low nibble first."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def linear_wq_reference(
    x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Dequantize, then an fp32 matmul: x [..., K] -> [..., N]."""
    out = x.to(torch.float32) @ w.dequantize().T
    return out if bias is None else out + bias


def quantize_act_blocks(x: torch.Tensor) -> torch.Tensor:
    """x fp32 [M, K] (K a multiple of 32) as int8 per block of 32 inputs, dequantized back to fp32
    [M, K]: scale = amax / 127, q = round_half_even(x * (127 / amax)) (sgl-kernel's linear_wq_a8
    makes the same bytes with the same fp32 operations)."""
    m, k = x.shape
    blocks = x.to(torch.float32).reshape(m, k // ACT_BLOCK, ACT_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # [M, K / 32, 1]
    # Tensor by tensor: a Python scalar numerator may become a reciprocal multiply (one rounding off).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp_(-127, 127)
    return (q * (amax / torch.full_like(amax, 127.0))).reshape(m, k)


def linear_wq_a8_reference(
    x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The int8-activation product: x quantized per 32 inputs and dequantized, then the fp32
    reference. x [M, K] -> [M, N]."""
    return linear_wq_reference(quantize_act_blocks(x), w, bias)


def wq_rows_bound(w: GroupQuantWeight, wq_max_tokens: int) -> int:
    """Batches of up to this many rows read w (larger ones the fp32 weight's GEMM): the machine's
    wq_max_tokens crossover, or every batch (A8_PACKED_MAX_ROWS) for a form whose panels serve its
    batches (every row, or the batches wq_batch_a8 gives them; up to wq_batch_a8_max_tokens where
    that bound is set): wq_kernel's "gemm" rows."""
    bound = crossovers()
    if panels_serve_every_row(w):
        return A8_PACKED_MAX_ROWS
    if not (bound.wq_batch_a8 and has_panels(w)):
        return wq_max_tokens
    upto = bound.wq_batch_a8_max_tokens
    return max(upto, wq_max_tokens) if upto else A8_PACKED_MAX_ROWS


def panels_serve_every_batch(w: GroupQuantWeight) -> bool:
    """Whether w's panels serve its every batch (so it needs no oneDNN copy): panels for every row,
    or the batches' panels (wq_batch_a8) with no wq_batch_a8_max_tokens bound above which the
    GEMM serves."""
    return wq_rows_bound(w, 0) >= A8_PACKED_MAX_ROWS


def has_panels(w: GroupQuantWeight) -> bool:
    """Whether w is read through the int8-activation panels (at every batch size)."""
    return w.int8_activations and w.a8_packed is not None


@functools.cache
def triton_wq_gemm() -> Callable[..., torch.Tensor] | None:
    """sgl-kernel's Triton dequant-GEMM (sgl_kernel/triton/wq_gemm.py) for CUDA tensors, or None
    without the `triton` package. Imported on first use only: a CPU-only install never imports
    triton."""
    try:
        import sgl_kernel
    except ImportError:
        return None
    if not sgl_kernel.triton_available():
        return None
    from sgl_kernel.triton.wq_gemm import wq_gemm

    return wq_gemm


def linear_wq(x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """On CUDA, the Triton dequant-GEMM (output in x's dtype, fp32 accumulation); on CPU,
    sgl-kernel's linear_wq when it can take x (2-D fp32 with contiguous rows); else the fp32
    reference. A form with int8_activations (CPU only) runs linear_wq_a8 or its reference where
    wq_kernel(w, rows) says "a8" (the rule: the installed crossovers and whether w has panels)."""
    if x.device.type == "cuda":
        gemm = triton_wq_gemm()
        if gemm is not None:
            return gemm(x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, bias)
        return linear_wq_reference(x, w, bias)
    kernel_ok = x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if wq_kernel(w, rows) == "a8":
        if kernel_ok and WQ_A8_KERNEL:
            return cpu_kernels.linear_wq_a8(
                x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, bias, packed=w.a8_packed
            )
        return linear_wq_a8_reference(x.reshape(-1, x.shape[-1]), w, bias).reshape(*x.shape[:-1], -1)
    if kernel_ok and WQ_KERNEL:
        return cpu_kernels.linear_wq(
            x, w.qweight, w.scales, w.offsets, w.bits, w.group_size, bias, kernel_form=w.kernel_form
        )
    return linear_wq_reference(x, w, bias)
