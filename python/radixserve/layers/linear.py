"""Linear layers and their CPU fast paths.

On CPU with fp32 weights, `prepare_cpu_linears` (called once after loading) gives every Linear
the fastest forms this machine has, and `linear` picks per call by batch size (measured on the
built-in model's decode, docs/benchmarks.md):

0. `--quantization w8a8_int8` (`quantize_linears`): the layer has an int8 copy of its weight with
   per-output-channel scales, and every batch size runs the W8A8 linear (layers/quantization.py:
   sgl-kernel's int8 kernel, or its torch reference). Such layers get none of the forms below.
0b. A weight-only group-quantized form (`weight_wq`, layers/group_quant.py: GGUF and int4/int8
   weight-only formats), batches of at most `wq_max_tokens` tokens: the fp32 weight is exactly its
   dequantization, so larger batches take the fp32 forms below unchanged. A form marked for int8
   activations with its 8-row panels (--cpu-wq-int8-activations) is read at every batch size
   (wq_rows_bound): the panel kernel beat the fp32 forms at every row count measured, so such a
   layer gets no oneDNN copy (path 3). So does a marked form where this CPU's tuning chose
   int8-activation batches (Crossovers.wq_batch_a8, `use_a8_batch_panels`): its batches above
   wq_max_tokens run the panels' GEMM tiles, its small ones keep wq_a8_max_tokens' choice. Where
   only the small products won on panels (Crossovers.wq_a8_small_panels, `use_a8_small_panels`)
   the layer gets panels for those and keeps its oneDNN copy (group_quant.wq_kernel). One exception:
   `--quantization w8a8_int8`'s LM head (`quantize_lm_head`), whose fp32 weight is the tied
   embedding and stays as loaded; its batches above that bound compute with the fp32 head.

1. `--cpu-fp16-weights`, batches of at most `f16_max_tokens` tokens: sgl-kernel's `linear_f16`
   over an fp16 copy (F16C conversion, fp32 math). Small decode batches are bound by reading the
   weights, and fp16 halves the bytes.
2. Batches of at most `f32_small_max_tokens` tokens: sgl-kernel's `linear_f32`, which streams the
   plain fp32 weight faster than any GEMM library does at one or two tokens.
3. A weight prepacked for oneDNN (torch's mkldnn ops): every larger batch. torch's default fp32
   GEMM (MKL) runs 2-3x slower at the model's shapes on the AMD CPUs measured here; oneDNN's JIT
   kernels over a blocked weight layout are near peak from a few tokens up to prefill sizes.
   The price is a second copy of each linear weight (the plain one stays for path 2).
   With --cpu-bf16-gemm the packed copy is bf16 instead: inputs are rounded to bf16 and the
   output comes back as bf16 (then fp32), as on a bf16 GPU. On CPUs with AVX512_BF16 oneDNN's bf16
   GEMM runs ~2x its fp32 one; elsewhere it would be emulated and slower, so the flag is refused.
   A weight-only layer's packed copy (path 0b's batches) is bf16 also without the flag where the
   CPU's tuning chose it (Crossovers.wq_batch_bf16, `use_bf16_batch_gemm`): measured faster on
   this CPU and inside the quality band docs/quantization.md calls fp32's.
4. Without oneDNN (a torch built without it, or --disable-cpu-weight-prepack): `linear_f32` up to
   SMALL_BATCH_MAX_TOKENS tokens, F.linear beyond.

Everywhere else (GPU, fp16/bf16 models) it is F.linear. Results differ from F.linear only in
summation order (and by fp16 rounding of the weights on path 1).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers import cpu_fused
from radixserve.layers.activation import Activation
from radixserve.layers.cpu_crossovers import active as crossovers
from radixserve.layers.cpu_fused import cpu_kernels, fusable
from radixserve.layers.group_quant import (
    WQ_A8_PACKED,
    GroupQuantWeight,
    linear_wq,
    panels_serve_every_batch,
    with_int8_activations,
    wq_rows_bound,
)
from radixserve.layers.quantization import INT8_KERNEL, linear_w8a8, quantize_weight_int8
from radixserve.layers.weight_only import quantize_int8_groups

logger = logging.getLogger(__name__)

# The batch-size bounds between the forms (fp16, fp32 small-M and weight-only kernels vs oneDNN's
# GEMM) are per machine: layers/cpu_crossovers.py holds them (measured at start, or its defaults).
# Without oneDNN: up to this many tokens sgl-kernel's fp32 small-M kernel beats torch's GEMM.
SMALL_BATCH_MAX_TOKENS = 32
# Quantized (w8a8_int8) decode batches up to this size run as the fused compiled call
# (cpu_decode_runner.py). Both paths run the same int8 kernel at every size, so the fused call
# only saves Python overhead; the bound is fp16's, not tuned yet (docs/quantization.md).
INT8_FUSED_MAX_TOKENS = 16
# --quantization w8a8_int8's LM head: int8 weight-only in groups of this many inputs (GGUF Q8_0's
# layout; `quantize_lm_head`).
LM_HEAD_GROUP = 32


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_f16: torch.Tensor | None = None,
    weight_packed: torch.Tensor | None = None,
    weight_int8: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    weight_wq: GroupQuantWeight | None = None,
) -> torch.Tensor:
    """x [num_tokens, in] @ weight.T (+ bias), through the fastest form of the weight there is
    for this batch size (module docstring)."""
    if weight_int8 is not None:
        assert weight_scale is not None
        return linear_w8a8(x, weight_int8, weight_scale, bias)
    num_tokens, bound = x.shape[0], crossovers()
    if weight_wq is not None and num_tokens <= wq_rows_bound(weight_wq, bound.wq_max_tokens) and x.dim() == 2:
        return linear_wq(x, weight_wq, bias)
    if weight_f16 is not None and num_tokens <= bound.f16_max_tokens and _rows_ok(x):
        return cpu_kernels.linear_f16(x, weight_f16, bias)
    if (
        weight_packed is not None
        and num_tokens <= bound.f32_small_max_tokens
        and _rows_ok(x)
        and fusable(weight)
    ):
        return cpu_kernels.linear_f32(x, weight, bias)
    if weight_packed is not None and x.dim() == 2:
        if weight_packed.dtype == torch.bfloat16:
            return _linear_bf16(x, weight_packed, bias)
        # [num_tokens, out]; oneDNN wants dense rows.
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight_packed, bias, "none", [], "")
    if num_tokens <= SMALL_BATCH_MAX_TOKENS and _rows_ok(x) and fusable(weight):
        return cpu_kernels.linear_f32(x, weight, bias)
    return F.linear(x, weight, bias)


def _linear_bf16(x: torch.Tensor, weight_packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's bf16 GEMM (fp32 accumulation) over a bf16-packed weight; fp32 in and out. The
    bias is added in fp32 after the bf16 rounding of the product."""
    out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight_packed, None, "none", [], "")
    out = out.to(torch.float32)
    return out if bias is None else out.add_(bias)


def bf16_gemm_supported() -> bool:
    """Whether this CPU runs bf16 GEMMs natively (AVX512_BF16 or AMX), so --cpu-bf16-gemm pays,
    and oneDNN packs bf16 here (onednn_packs_bf16)."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    native = onednn_prepack_available() and any(getattr(cpu, c, lambda: False)() for c in checks)
    return native and onednn_packs_bf16()


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN takes a bf16 reorder: torch's feature checks read the CPU's flags, while
    ONEDNN_MAX_CPU_ISA (the AVX2 paths forced on an AVX-512 machine, docs/cpu_backend.md) makes
    oneDNN refuse it, and a server that chose bf16 batches then failed to start."""
    try:
        onednn_pack(torch.zeros(16, 32), torch.bfloat16)
    except RuntimeError:
        return False
    return True


def _rows_ok(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(-1) == 1 and fusable(x)


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) with optional CPU weight forms."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.weight_f16: torch.Tensor | None = None  # [out, in] fp16
        self.weight_packed: torch.Tensor | None = None  # oneDNN's blocked layout of [out, in]
        self.weight_int8: torch.Tensor | None = None  # [out, in] int8 (--quantization w8a8_int8)
        self.weight_scale: torch.Tensor | None = None  # [out] fp32, per output channel
        self.weight_wq: GroupQuantWeight | None = None  # weight-only group-quantized (layers/group_quant.py)
        self.greedy_head: Any = None  # an LM head's int8 copy for all-greedy steps (layers/greedy_head.py)

    @classmethod
    def sharing(cls, weight: nn.Parameter) -> Linear:
        """A bias-free Linear over an existing [out, in] weight (e.g. the LM head tied to the
        embedding); the weight is shared, not copied."""
        layer = cls(1, 1, bias=False)
        layer.weight = weight
        layer.out_features, layer.in_features = weight.shape
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, *self.derived_forms())

    def forward_act(self, x: torch.Tensor, act: Activation) -> torch.Tensor:
        """act(self(x)). Where the fp32 oneDNN GEMM serves x (path 3), oneDNN applies `act` in
        the GEMM's epilogue: the same values up to float rounding (bitwise, for erf GELU, on the
        development machine), without a second pass over the [num_tokens, out] output (about 10%
        of the time of a BERT FFN's first linear, docs/benchmarks.md)."""
        if self._takes_onednn_fp32(x):
            name, algorithm = act.onednn
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.weight_packed, self.bias, name, [], algorithm
            )
        return act.fn(self(x))

    def _takes_onednn_fp32(self, x: torch.Tensor) -> bool:
        """Whether linear() gives x to oneDNN's fp32 GEMM over the packed weight (conservatively:
        False sends the caller to the unfused path, which is always right)."""
        n, bound = x.shape[0], crossovers()
        return (
            self.weight_packed is not None
            and self.weight_packed.dtype == torch.float32
            and self.weight_int8 is None
            and x.dim() == 2
            and n > bound.f32_small_max_tokens
            and (self.weight_f16 is None or n > bound.f16_max_tokens)
            and (self.weight_wq is None or n > wq_rows_bound(self.weight_wq, bound.wq_max_tokens))
        )

    def derived_forms(self) -> tuple[torch.Tensor | None, ...]:
        """linear()'s optional weight forms, in its argument order."""
        return self.weight_f16, self.weight_packed, self.weight_int8, self.weight_scale, self.weight_wq

    def drop_derived(self) -> None:
        """Forget every form derived from the weight (it changed, or is released)."""
        self.weight_f16 = self.weight_packed = self.weight_int8 = self.weight_scale = None
        self.weight_wq = None
        self.greedy_head = None


def _cpu_fp32_linears(modules: list[nn.Module]) -> list[Linear]:
    """Every Linear in `modules` with an fp32 weight on the CPU."""
    layers = [m for root in modules for m in root.modules() if isinstance(m, Linear)]
    return [m for m in layers if m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]


def onednn_prepack_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def prepare_cpu_linears(modules: list[nn.Module], fp16: bool, prepack: bool, bf16_gemm: bool = False) -> None:
    """Give every fp32 CPU Linear in `modules` its fast forms (module docstring): an fp16 copy
    when `fp16`, and a oneDNN-packed copy when `prepack` (bf16 when `bf16_gemm`). Logs what it did
    and what it cost."""
    # Quantized layers are left out: the int8 kernel serves every size.
    layers = [m for m in _cpu_fp32_linears(modules) if m.weight_int8 is None]
    # A form read through its int8-activation panels at every batch size needs no oneDNN copy; one
    # with panels for some rows only (small products, or batches up to a bound) keeps it for the
    # others, also when a weight update re-derives the forms of a checkpoint's kept panels.
    layers = [m for m in layers if m.weight_wq is None or not panels_serve_every_batch(m.weight_wq)]
    if fp16:
        # A weight-only quantized layer reads its integers at the sizes the fp16 copy would serve.
        layers_f16 = [m for m in layers if m.weight_wq is None]
        if not cpu_fused.ENABLED:
            raise RuntimeError(
                "--cpu-fp16-weights needs sgl-kernel's compiled CPU extension "
                "(`pip install --no-build-isolation -e sgl-kernel`, which make setup runs)"
            )
        for layer in layers_f16:
            layer.weight_f16 = layer.weight.detach().to(torch.float16).contiguous()
        added = sum(layer.weight_f16.numel() * 2 for layer in layers_f16)
        logger.info("fp16 weight copies: +%.0f MiB", added / 2**20)
    if bf16_gemm and not (prepack and bf16_gemm_supported()):
        raise RuntimeError(
            "--cpu-bf16-gemm needs oneDNN weight prepacking and a CPU with AVX512_BF16 or AMX "
            "(elsewhere bf16 GEMMs are emulated and run slower than fp32)"
        )
    if prepack and not onednn_prepack_available():
        logger.warning("oneDNN is not available in this torch build: CPU linears use F.linear")
        prepack = False
    if prepack:
        packed_dtype = torch.bfloat16 if bf16_gemm else torch.float32
        for layer in layers:
            layer.weight_packed = onednn_pack(layer.weight, packed_dtype)
        added = sum(layer.weight.numel() * packed_dtype.itemsize for layer in layers)
        logger.info(
            "CPU linears: %d weights prepacked for oneDNN in %s (+%.0f MiB)",
            len(layers),
            "bf16" if bf16_gemm else "fp32",
            added / 2**20,
        )


def onednn_pack(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """oneDNN's prepacked copy of `weight` in `dtype` (what _linear_bf16 / the fp32 GEMM read)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), None)


def use_bf16_batch_gemm(modules: list[nn.Module]) -> int:
    """Repack every weight-only quantized layer's fp32 oneDNN copy in `modules` to bf16, so its
    batches above wq_max_tokens run oneDNN's bf16 GEMM (Crossovers.wq_batch_bf16). The fp32
    weight (the form's exact dequantization) stays: small batches and weight reads use it.
    Returns how many layers changed; logs what it cost."""
    layers = [
        m
        for m in _cpu_fp32_linears(modules)
        if m.weight_wq is not None and m.weight_packed is not None and m.weight_packed.dtype == torch.float32
    ]
    for layer in layers:
        # One layer at a time: the fp32 pack is freed before the next bf16 one is made.
        layer.weight_packed = onednn_pack(layer.weight, torch.bfloat16)
    if layers:
        saved = sum(layer.weight.numel() * 2 for layer in layers)
        logger.info(
            "CPU linears: %d weight-only layers' batch copies repacked in bf16 (-%.0f MiB)",
            len(layers),
            saved / 2**20,
        )
    return len(layers)


def use_a8_batch_panels(modules: list[nn.Module], keep_gemm: bool = False) -> int:
    """Give every CPU Linear in `modules` whose weight-only form is marked for int8 activations
    (and has no panels yet) its 8-row panels (group_quant.with_int8_activations(panels=True)), and
    drop its oneDNN copy unless `keep_gemm` (Crossovers.wq_batch_a8_max_tokens: batches above it
    keep the GEMM): its batches above wq_max_tokens then run linear_wq_a8 on the panels
    (Crossovers.wq_batch_a8, group_quant.a8_batch). The fp32 weight stays. Returns how many layers
    changed; logs what it cost (the panels hold the form's own bytes: about the file's size)."""
    return _add_a8_panels(modules, keep_gemm=keep_gemm)


def use_a8_small_panels(modules: list[nn.Module]) -> int:
    """The same panels for the products of at most wq_a8_max_tokens rows only
    (Crossovers.wq_a8_small_panels, group_quant.wq_kernel): the oneDNN copy stays for the
    batches, which keep the GEMM this CPU chose for them."""
    return _add_a8_panels(modules, keep_gemm=True)


def _add_a8_panels(modules: list[nn.Module], keep_gemm: bool) -> int:
    if not WQ_A8_PACKED:
        return 0
    layers = [
        m
        for m in _cpu_fp32_linears(modules)
        if m.weight_wq is not None and m.weight_wq.int8_activations and m.weight_wq.a8_packed is None
    ]
    added = freed = 0
    for layer in layers:
        layer.weight_wq = with_int8_activations(layer.weight_wq, panels=True)
        added += layer.weight_wq.a8_packed.nbytes()
        if layer.weight_packed is not None and not keep_gemm:
            freed += layer.weight_packed.numel() * layer.weight_packed.element_size()
            layer.weight_packed = None
    if layers:
        logger.info(
            "CPU linears: %d weight-only layers' %s on int8-activation panels (+%.0f MiB panels, "
            "-%.0f MiB oneDNN copies)",
            len(layers),
            "small products" if keep_gemm else "batches",
            added / 2**20,
            freed / 2**20,
        )
    return len(layers)


def quantize_linears(modules: list[nn.Module]) -> None:
    """--quantization w8a8_int8: give every fp32 CPU Linear in `modules` an int8 copy of its weight
    with per-output-channel scales (layers/quantization.py); `linear` then runs W8A8 for them. The
    fp32 weight stays (weight updates and reads use it, and re-quantize). Logs what it did."""
    layers = _cpu_fp32_linears(modules)
    for layer in layers:
        layer.weight_int8, layer.weight_scale = quantize_weight_int8(layer.weight)
    int8_bytes = sum(layer.weight_int8.numel() for layer in layers)
    logger.info(
        "w8a8_int8: %d linear weights quantized to int8 (%.0f MiB int8, from %.0f MiB fp32), run by %s",
        len(layers),
        int8_bytes / 2**20,
        int8_bytes * 4 / 2**20,
        "sgl-kernel's linear_int8"
        if INT8_KERNEL
        else "the torch reference (sgl-kernel's linear_int8 not built)",
    )


def quantize_lm_head(lm_head: nn.Module | None) -> None:
    """--quantization w8a8_int8: give the LM head (the runner's Linear, or a TP rank's block of it)
    an int8 weight-only form in groups of LM_HEAD_GROUP inputs, read by batches of up to
    `wq_max_tokens` tokens (decode, a prefill's last-token logits). The fp32 weight stays as it is
    (in a tied model it is the embedding's), and larger batches use it. Weight-only rather than W8A8 keeps the
    head's error far below the decoder's (docs/quantization.md). Logs what it did."""
    head = getattr(lm_head, "local_head", lm_head)  # GatheredLMHead under TP: this rank's vocab block
    if not isinstance(head, Linear) or head.weight.dtype != torch.float32 or head.weight.device.type != "cpu":
        return
    in_features = head.weight.shape[1]
    group = LM_HEAD_GROUP if in_features % LM_HEAD_GROUP == 0 else in_features
    if group % 16:  # GroupQuantWeight's groups are multiples of 16 inputs
        logger.info("w8a8_int8: the LM head stays fp32 (%d inputs: no int8 group layout)", in_features)
        return
    head.weight_wq = quantize_int8_groups(head.weight, group)
    logger.info(
        "w8a8_int8: LM head int8 weight-only, groups of %d (%.0f MiB read per step instead of %.0f MiB "
        "of fp32) for batches up to wq_max_tokens (logged with the crossovers); larger batches use the fp32 head",
        group,
        head.weight_wq.nbytes() / 2**20,
        head.weight.numel() * 4 / 2**20,
    )
