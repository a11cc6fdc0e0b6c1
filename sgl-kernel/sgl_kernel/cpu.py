"""The compiled CPU kernels (`sgl_kernel._cpu`), built by `make setup` against the installed torch.

The extension is optional: `available()` is False when it was not built (no compiler, or an
isolated pip build without torch), and callers then use their pure-torch reference paths.
Set RADIXSERVE_DISABLE_CPU_KERNELS=1 to force those paths (for A/B runs and tests).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

# pack_wq_a8 re-exported: the packed weight linear_wq_a8 takes.
from sgl_kernel.wq_a8_pack import WqA8Packed, WqA8PackedExperts
from sgl_kernel.wq_a8_pack import pack_wq_a8 as pack_wq_a8
from sgl_kernel.wq_a8_pack import pack_wq_a8_experts as pack_wq_a8_experts

_ext: ModuleType | None
try:
    from sgl_kernel import _cpu as _ext
except ImportError:  # not built: the pure-torch paths are used
    _ext = None


def available() -> bool:
    return _ext is not None and os.environ.get("RADIXSERVE_DISABLE_CPU_KERNELS", "0") in ("", "0")


def _lib() -> ModuleType:
    if _ext is None:
        raise RuntimeError("sgl_kernel._cpu is not built; check sgl_kernel.cpu.available() first")
    return _ext


def attention_kv_dtypes() -> tuple[torch.dtype, ...]:
    """The KV pool dtypes decode_attention and extend_attention read in this build (an older
    build: decode fp32/bf16, extend fp32; see extend_attention_kv_dtypes)."""
    names = getattr(_ext, "attention_kv_dtypes", None) if available() else None
    if names is None:
        return (torch.float32, torch.bfloat16) if available() else ()
    return tuple(getattr(torch, str(n)) for n in names)


def extend_attention_kv_dtypes() -> tuple[torch.dtype, ...]:
    """The KV pool dtypes extend_attention reads here (older builds: fp32 only)."""
    if not hasattr(_ext, "attention_kv_dtypes"):
        return (torch.float32,) if available() else ()
    return attention_kv_dtypes()


def _scale_kwargs(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale go together (int8 pools)")
    return {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}


def decode_attention(
    q: torch.Tensor,  # [bs, num_heads, head_dim] fp32 (head_dim contiguous)
    k_buf: torch.Tensor,  # [pool_size, num_kv_heads, head_dim] fp32, bf16, fp8 (e4m3fn, e5m2) or int8
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,  # [max_reqs, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs] int64
    seq_lens: torch.Tensor,  # [bs] int64
    scale: float,
    out: torch.Tensor | None = None,  # [bs, num_heads, head_dim] fp32
    k_scale: torch.Tensor | None = None,  # [pool_size, num_kv_heads] fp32: int8 pools only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax(q·K^T·scale)·V over each request's slots req_to_token[row, :seq_len], reading the
    pool in place and dequantizing each row as it is read (int8: row * its k_scale / v_scale).
    Returns out [bs, num_heads, head_dim]."""
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    _lib().decode_attention(
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        req_pool_indices,
        seq_lens,
        scale,
        **_scale_kwargs(k_scale, v_scale),
    )
    return out


def extend_attention_isa() -> str:
    """The vector path extend_attention was compiled with: "avx512", "avx2", or "none" (built
    without AVX2: extend_attention raises and callers keep the torch-native path)."""
    return str(getattr(_ext, "extend_attention_isa", "none")) if available() else "none"


def extend_attention_bf16_dot() -> bool:
    """Whether extend_attention runs bf16 pools through vdpbf16ps tiles here (AVX512_BF16 builds):
    q * scale and the softmax weights are then rounded to bf16 before their fp32-accumulated
    products, as a bf16 engine computes (docs/cpu_backend.md); fp32 pools stay exact."""
    return bool(getattr(_ext, "extend_attention_bf16_dot", False)) and extend_attention_isa() != "none"


def decode_attention_bf16_dot(head_dim: int) -> bool:
    """Whether decode_attention folds bf16 pools of this head_dim by vdpbf16ps here (AVX512_BF16
    builds, head_dim a multiple of 32 up to 256, up to 8 query heads per KV head): q * scale and
    the softmax weights rounded to bf16, as extend_attention_bf16_dot; fp32 pools stay exact."""
    built = bool(getattr(_ext, "decode_attention_bf16_dot", False)) and available()
    return built and head_dim % 32 == 0 and head_dim <= 256


def extend_attention_supported(head_dim: int) -> bool:
    """Whether extend_attention handles this shape here (built, with AVX2, head_dim % 8 == 0)."""
    return extend_attention_isa() != "none" and head_dim % 8 == 0 and 8 <= head_dim <= 512


def extend_attention_takes_tree_mask() -> bool:
    """Whether this build's extend_attention takes a draft tree's mask (older builds do not)."""
    return bool(getattr(_ext, "extend_attention_tree_mask", False)) and extend_attention_isa() != "none"


def _check_extend_inputs(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    index_tensors: dict[str, torch.Tensor],
) -> None:
    """Cheap shape/dtype/layout checks with clear messages; the kernel re-checks them and also
    validates every length and slot (reading outside the pool would crash, not raise)."""
    tensors = {"q": q, "k_buf": k_buf, "v_buf": v_buf, "req_to_token": req_to_token, **index_tensors}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(f"extend_attention: {name} must be a CPU tensor")
    if q.dtype != torch.float32:
        raise ValueError(f"extend_attention: q must be float32, got {q.dtype}")
    if k_buf.dtype != v_buf.dtype or k_buf.dtype not in extend_attention_kv_dtypes():
        raise ValueError(
            f"extend_attention: k_buf/v_buf must both be one of {extend_attention_kv_dtypes()}, got "
            f"{k_buf.dtype} and {v_buf.dtype}"
        )
    for name in ("q", "k_buf", "v_buf"):
        if tensors[name].dim() != 3:
            raise ValueError(f"extend_attention: {name} must be 3-D, got shape {tuple(tensors[name].shape)}")
    if k_buf.shape != v_buf.shape or k_buf.shape[2] != q.shape[2]:
        raise ValueError(
            f"extend_attention: k_buf {tuple(k_buf.shape)} and v_buf {tuple(v_buf.shape)} must both be "
            f"[pool_size, num_kv_heads, head_dim={q.shape[2]}]"
        )
    num_heads, num_kv_heads, head_dim = q.shape[1], k_buf.shape[1], q.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"extend_attention: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    if head_dim % 8 != 0 or not 8 <= head_dim <= 512:
        raise ValueError(f"extend_attention: head_dim {head_dim} must be a multiple of 8 in [8, 512]")
    if q.stride(2) != 1:
        raise ValueError("extend_attention: q's head_dim must be contiguous (token/head strides may be any)")
    if not (k_buf.is_contiguous() and v_buf.is_contiguous()):
        raise ValueError("extend_attention: k_buf and v_buf must be contiguous")
    if req_to_token.dtype != torch.int32 or req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError(
            "extend_attention: req_to_token must be int32 [rows, max_context] with contiguous rows"
        )
    bs = index_tensors["seq_lens"].shape[0] if index_tensors["seq_lens"].dim() == 1 else -1
    for name, t in index_tensors.items():
        if t.dtype != torch.int64 or t.dim() != 1 or not t.is_contiguous() or t.shape[0] != bs:
            raise ValueError(
                f"extend_attention: {name} must be a contiguous int64 [bs] tensor (bs = len(seq_lens))"
            )


def extend_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim] fp32 (head_dim contiguous)
    k_buf: torch.Tensor,  # [pool_size, num_kv_heads, head_dim] contiguous, a dtype decode_attention reads
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,  # [max_reqs, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs] int64
    seq_lens: torch.Tensor,  # [bs] int64: prefix + new tokens
    extend_lens: torch.Tensor | list[int],  # [bs] int64: new tokens
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads * head_dim] fp32, contiguous
    tree_mask: torch.Tensor | None = None,  # [sum(extend_lens^2)] uint8: draft trees, see below
    k_scale: torch.Tensor | None = None,  # [pool_size, num_kv_heads] fp32: int8 pools only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal extend (prefill) attention over the paged KV pool, as TorchNativeAttnBackend's
    forward_extend computes it. The new tokens' K/V must already be stored in the pool.

    q holds every request's new tokens, concatenated in batch order (sum(extend_lens) rows).
    Request b's key j (0 <= j < seq_lens[b]) is pool slot req_to_token[req_pool_indices[b], j];
    its new token i sits at position prefix_b + i (prefix_b = seq_lens[b] - extend_lens[b]) and
    attends keys 0 .. prefix_b + i. Query head h reads KV head h // (num_heads // num_kv_heads).
    With tree_mask (speculative draft trees), new token i of request b attends the whole prefix and
    the new tokens j with mask_b[i, j] != 0 instead, where mask_b is request b's [e_b, e_b] block
    of tree_mask (row-major, requests concatenated); it must hold the diagonal and nothing above it.
    K/V rows are dequantized as they are read, as in decode_attention.
    Returns out [num_tokens, num_heads * head_dim] fp32. Raises ValueError on a wrong dtype,
    shape or layout (and on lengths or slots outside req_to_token / the pool)."""
    if not isinstance(extend_lens, torch.Tensor):
        extend_lens = torch.tensor(extend_lens, dtype=torch.int64)
    index_tensors = {"req_pool_indices": req_pool_indices, "seq_lens": seq_lens, "extend_lens": extend_lens}
    _check_extend_inputs(q, k_buf, v_buf, req_to_token, index_tensors)
    shape = (q.shape[0], q.shape[1] * q.shape[2])
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"extend_attention: out must be a contiguous float32 {shape} tensor")
    scales = _scale_kwargs(k_scale, v_scale)
    if tree_mask is not None:
        if tree_mask.dtype == torch.bool:
            tree_mask = tree_mask.to(torch.uint8)
        if tree_mask.dtype != torch.uint8 or tree_mask.dim() != 1 or not tree_mask.is_contiguous():
            raise ValueError(
                "extend_attention: tree_mask must be a contiguous uint8 [sum(extend_lens^2)] tensor"
            )
    _lib().extend_attention(
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_lens,
        scale,
        tree_mask,
        **scales,
    )
    return out


def linear_f16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ weight.T (+ bias) with weight [N, K] stored in fp16; fp32 math.
    Returns [M, N] fp32. Fast for small M (reads the weight once, converting with F16C)."""
    return _lib().linear_f16(x, weight, bias)


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias), all fp32, for small M: streams the weight once with a
    register-tiled AVX2 kernel (torch's GEMM is 1.2-1.9x slower for M <= 32 on AVX2 CPUs)."""
    return _lib().linear_f32(x, weight, bias)


_INT8_ISA_CODES = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}


def _built_isas(kernel: str, isas: str) -> list[str]:
    """The code paths `kernel` can be forced onto in this build (the extension's list `isas`;
    "scalar" always); [] when the build lacks the kernel (an older extension)."""
    if not available() or not hasattr(_ext, kernel):
        return []
    return [str(isa) for isa in getattr(_ext, isas, ["scalar"])]


def _isa_code(kernel: str, isa: str) -> int:
    if isa not in _INT8_ISA_CODES:
        raise ValueError(f"{kernel}: isa must be one of {sorted(_INT8_ISA_CODES)}, got {isa!r}")
    return _INT8_ISA_CODES[isa]


def linear_int8_isas() -> list[str]:
    """`linear_int8`'s code paths here: "scalar", "avx2", "avx512" for AVX-512 VNNI (_built_isas)."""
    return _built_isas("linear_int8", "linear_int8_isas")


def linear_int8(
    x: torch.Tensor,  # [M, K] fp32, rows contiguous
    weight: torch.Tensor,  # [N, K] int8, contiguous
    weight_scale: torch.Tensor,  # [N] fp32: row n of the real weight ~= weight[n] * weight_scale[n]
    bias: torch.Tensor | None = None,  # [N] fp32
    isa: str = "auto",
) -> torch.Tensor:
    """W8A8 linear: each row of x quantized to int8 (symmetric, scale amax/127, round half to
    even), int32 dot products with the int8 weight, y = dot * x_scale * weight_scale (+ bias), fp32
    [M, N]. `isa` forces a code path ("scalar", "avx2", "avx512"; "auto" the best built); every
    path gives the same bits. radixserve.layers.quantization holds the torch reference."""
    return _lib().linear_int8(x, weight, weight_scale, bias, _isa_code("linear_int8", isa))


def linear_wq_isas() -> list[str]:
    """`linear_wq`'s code paths here: "scalar", "avx2", "avx512" (_built_isas)."""
    return _built_isas("linear_wq", "linear_wq_isas")


def linear_wq_half_groups() -> bool:
    """Whether this build's linear_wq (and DecodeModel's wq layers) takes fp16 scales and offsets,
    widened to fp32 exactly (older builds: fp32 only)."""
    return available() and hasattr(_ext, "linear_wq") and bool(getattr(_ext, "linear_wq_half_groups", False))


def linear_wq(
    x: torch.Tensor,  # [M, K] fp32, rows contiguous
    qweight: torch.Tensor,  # bits 8: int8 [N, K]; bits 4: uint8 [N, K // 2], input 2j in byte j's low nibble
    scales: torch.Tensor,  # [N, K // group_size] fp32 (or fp16, see below), contiguous
    offsets: torch.Tensor | None,  # [N, K // group_size] scales' dtype, or None
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,  # [N] fp32
    isa: str = "auto",
    kernel_form: object = None,
) -> torch.Tensor:
    """Weight-only group-quantized linear: y = x @ w.T (+ bias), fp32 [M, N], where w[n, k] =
    q[n, k] * scales[n, g] (+ offsets[n, g]) with g = k // group_size (layers/group_quant.py's
    GroupQuantWeight; q in 0..15 for bits 4, int8 for bits 8). Activations and sums stay fp32: the
    result is the dequantize-then-matmul reference's up to summation order and FMA contraction.
    Fast for small M (decode): it streams the integers once. fp16 scales and offsets (both, or
    scales alone without offsets) are widened to fp32 exactly: the same bits as fp32 tensors of the
    same values, for fewer bytes read (GGUF's d and m are fp16). `isa` forces a code path ("scalar",
    "avx2", "avx512"; "auto" the best built). `kernel_form` is reserved for a repacked layout; this
    build reads the canonical tensors and takes None only. Raises RuntimeError on a wrong dtype,
    shape or layout."""
    code = _isa_code("linear_wq", isa)
    if kernel_form is not None:
        raise ValueError("linear_wq: this build has no repacked kernel_form; pass None")
    return _lib().linear_wq(x, qweight, scales, offsets, bits, group_size, bias, code)


def linear_wq_a8_isas() -> list[str]:
    """`linear_wq_a8`'s code paths here: "scalar", "avx2", "avx512" for AVX-512 VNNI (vpdpbusd on
    256-bit vectors; the same bits as "avx2") (_built_isas). The panel kernels (`packed`,
    moe_wq_a8_packed) take the same names but "scalar"."""
    return _built_isas("linear_wq_a8", "linear_wq_a8_isas")


def linear_wq_a8_packed_available() -> bool:
    """Whether linear_wq_a8 can take a pack_wq_a8 weight (an AVX2 build with the panel kernel)."""
    return available() and bool(getattr(_ext, "linear_wq_a8_packed_available", False))


def linear_wq_a8(
    x: torch.Tensor,  # [M, K] fp32, rows contiguous
    qweight: torch.Tensor,  # as linear_wq's
    scales: torch.Tensor,  # [N, K // group_size] fp32
    offsets: torch.Tensor | None,  # [N, K // group_size] fp32, or None
    bits: int,
    group_size: int,  # a multiple of 32
    bias: torch.Tensor | None = None,  # [N] fp32
    isa: str = "auto",
    packed: WqA8Packed | None = None,
) -> torch.Tensor:
    """linear_wq with int8 activations (llama.cpp's Q8_0 form of x): each block of 32 inputs of a
    row of x is quantized to int8 (scale amax / 127, round half to even), the products with the
    weight's integers summed in int32 per block, then scaled: fp32 [M, N]. Equal to
    layers/group_quant.py's linear_wq_a8_reference up to fp32 summation order. `isa`: "scalar",
    "avx2", "avx512" (VNNI) or "auto" (linear_wq_a8_isas; RuntimeError for one not built here).
    `packed` (pack_wq_a8 of the same weight, AVX2 builds only): the panel kernel reads it instead
    of qweight / scales / offsets (any isa but "scalar"). Raises RuntimeError on a wrong dtype,
    shape or layout."""
    code = _isa_code("linear_wq_a8", isa)
    if packed is not None:
        if isa == "scalar":
            raise ValueError(
                "linear_wq_a8: a packed weight runs the SIMD panel kernel; isa scalar takes none"
            )
        return _lib().linear_wq_a8_packed(
            x, packed.q, packed.scales, packed.offsets, packed.n, packed.bits, packed.group_size, bias,
            packed.zero_point, code,
        )  # fmt: skip
    return _lib().linear_wq_a8(x, qweight, scales, offsets, bits, group_size, bias, code)


def moe_wq_a8_packed_available() -> bool:
    """Whether moe_wq_a8_packed is built (an AVX2 build with the panel kernel)."""
    return linear_wq_a8_packed_available() and hasattr(_ext, "moe_wq_a8_packed")


def moe_wq_a8_packed(
    x: torch.Tensor,  # [T, H] fp32, rows contiguous
    topk_ids: torch.Tensor,  # [T, top_k] int64: local expert ids; outside [0, E) another rank's
    topk_weights: torch.Tensor,  # [T, top_k] fp32
    w13: WqA8PackedExperts,  # every expert's gate rows then up rows [2 * inter, H]
    w2: WqA8PackedExperts,  # every expert's down projection [H, inter]
    isa: str = "auto",  # the panel kernel's path: "avx2", "avx512" (VNNI) or "auto"
) -> torch.Tensor:
    """A MoE layer's routed experts with int8 activations on their stacked panels, in one call:
    fp32 [T, H], the sum over each token's pairs of weight * down(silu(gate) * up). Equal bit for
    bit to running each expert's rows through linear_wq_a8 on w13.expert(e) / w2.expert(e),
    silu_and_mul, then scaling by the weights and index_add_ in expert order (layers/moe/
    fused_moe_cpu.py's grouped path), on either isa. Raises RuntimeError on a wrong dtype, shape or
    layout, or an isa not built here ("scalar" included)."""
    return _lib().moe_wq_a8_packed(
        x, topk_ids, topk_weights,
        w13.q, w13.scales, w13.offsets, w13.bits, w13.group_size,
        w2.q, w2.scales, w2.offsets, w2.bits, w2.group_size,
        w13.zero_point, w2.zero_point, _isa_code("moe_wq_a8_packed", isa),
    )  # fmt: skip


def greedy_head_isas() -> list[str]:
    """`greedy_head_candidates`' code paths here: "scalar", "avx2", "avx512" (_built_isas)."""
    return _built_isas("greedy_head_candidates", "greedy_head_isas")


def greedy_head_candidates(
    x: torch.Tensor,  # [M, K] fp32, rows contiguous
    u: torch.Tensor,  # int8 [N, K], the head as t[n] * u[n, k], packed [ceil(N/4), ceil(K/32), 4, 32]
    stats: torch.Tensor,  # [N, 3] fp32: t, an upper bound of ||w - t u||, of ||t u||
    umax: float,  # an upper bound of every ||u[n]||
    isa: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The vocabulary rows that may hold each row's argmax of x @ w.T (layers/greedy_head.py):
    (indices int64 [C], counts int64 [M]), row m's candidates being the next counts[m] indices,
    ascending. Counts of -1 (and no indices): x is not finite, nothing was proven."""
    return _lib().greedy_head_candidates(x, u, stats, umax, _isa_code("greedy_head_candidates", isa))


def lora_delta_available() -> bool:
    """Whether this build has `lora_delta_` (older extensions do not)."""
    return available() and hasattr(_ext, "lora_delta_")


def lora_delta_(
    x: torch.Tensor,  # [n, in] fp32 or bf16, rows contiguous
    a: torch.Tensor,  # [slots, rank, in] fp32 or bf16, contiguous
    b: torch.Tensor,  # [slots, rank, out], a's dtype, contiguous; holds the adapter's scaling
    token_slots: torch.Tensor,  # [n] int64: each row's slot, -1 for none
    out: torch.Tensor,  # [n, out] x's dtype, rows contiguous (a column slice of a wider output is fine)
) -> None:
    """In place: out[t] += (x[t] @ a[s]^T) @ b[s] for every row t whose slot s = token_slots[t] is
    >= 0; rows of slot -1 are untouched. One call for every adapter in the batch (the rows are
    grouped by slot inside), fp32 accumulation, the sum rounded once into out.
    radixserve.lora.kernels.lora_delta_reference is the torch reference. Raises ValueError on a
    wrong dtype, shape or layout, or a slot outside [-1, slots)."""
    _lib().lora_delta_(x, a, b, token_slots, out)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, N] fp32 (rows contiguous) -> x * rsqrt(mean(x^2) + eps) * weight, a new [M, N]."""
    return _lib().rmsnorm(x, weight, eps)


def fused_add_rmsnorm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place on both [M, N] fp32 tensors: residual += x, then x = rmsnorm(residual) * weight."""
    _lib().fused_add_rmsnorm_(x, residual, weight, eps)


def rotary_neox_(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, num_heads, head_dim] fp32, head_dim contiguous (may be a qkv view)
    k: torch.Tensor,  # [T, num_kv_heads, head_dim] fp32
    cos: torch.Tensor,  # [max_position, head_dim / 2] fp32
    sin: torch.Tensor,
) -> None:
    """Neox-style rotary embedding applied in place to q and k."""
    _lib().rotary_neox_(positions, q, k, cos, sin)


def argmax_rows_available() -> bool:
    """Whether this build has argmax_rows (older builds: torch.argmax)."""
    return available() and hasattr(_ext, "argmax_rows")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for a CPU fp32 [rows, n] with contiguous rows, vectorized: the same
    indices (the first of each row's maximum; a NaN counts as the greatest)."""
    return _lib().argmax_rows(x)


def argmax_rows_checked_available() -> bool:
    """Whether this build has argmax_rows_checked (older builds: argmax and a torch guard)."""
    return available() and hasattr(_ext, "argmax_rows_checked")


def argmax_rows_checked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax_rows(x) and, per row, whether the chosen logit x[row, id] is not finite (NaN or
    +-inf): (int64 [rows], bool [rows])."""
    return _lib().argmax_rows_checked(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2d] fp32 (gate then up) -> silu(gate) * up, [M, d]."""
    return _lib().silu_and_mul(x)


def store_kv_dtypes() -> tuple[torch.dtype, ...]:
    """The pool dtypes store_kv writes in this build (older builds: fp32 only)."""
    if not available():
        return ()
    return attention_kv_dtypes() if getattr(_ext, "store_kv_quantizes", False) else (torch.float32,)


def store_kv(
    k_buf: torch.Tensor,  # [pool_size, num_kv_heads, head_dim], a store_kv_dtypes() dtype
    v_buf: torch.Tensor,
    loc: torch.Tensor,  # [T] int64 slots
    k: torch.Tensor,  # [T, num_kv_heads, head_dim] fp32, each token's heads contiguous
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,  # [pool_size, num_kv_heads] fp32: int8 pools only
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_buf[loc] = k and v_buf[loc] = v in one call, each row quantized to the pool's dtype as
    radixserve.mem_cache.kv_dtype does it (the same bits; int8 also writes the row's scale)."""
    _lib().store_kv(k_buf, v_buf, loc, k, v, **_scale_kwargs(k_scale, v_scale))


def decode_model(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rms_norm_eps: float,
    scaling: float,
    cos: torch.Tensor,  # [max_position, head_dim / 2] fp32
    sin: torch.Tensor,
) -> object:
    """A `DecodeModel`: a Llama-family decoder stack whose decode step is one call. Fill it with
    `add_layer(input_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, post_norm, gate_up_w, gate_up_b,
    down_w, down_b, k_buf, v_buf)` per layer (weights fp32, fp16 or int8, optional ones None), for
    int8 weights `set_layer_scales(index, qkv_s, o_s, gate_up_s, down_s)` (their per-row fp32
    scales, linear_int8's), for weight-only quantized ones `set_layer_wq(index, qkv, o, gate_up,
    down)` (each (qweight, scales, offsets, bits, group_size) as linear_wq takes them, or None),
    then `set_layer_wq_a8(index, qkv, o, gate_up, down)` (bools: the forms that take int8
    activations, linear_wq_a8, at batches of at most `set_wq_a8_max_tokens(n)` rows; 0, the
    default: none), and `set_final_norm(w)`; with LoRA adapters `set_layer_lora(index, num_slots, qkv, o, gate_up,
    down)` (per projection a list of (a [slots, rank, in], b [slots, rank, width], output column
    offset) over the LoRA pool's buffers, read in place); then `forward(hidden, positions,
    out_cache_loc, req_to_token, req_pool_indices, seq_lens, token_slots=None)` returns the final
    normed hidden states (token_slots int64 [bs]: each row's LoRA slot, -1 for the base model)."""
    return _lib().DecodeModel(num_heads, num_kv_heads, head_dim, rms_norm_eps, scaling, cos, sin)


DECODE_MODEL_PARTS = ("norm", "qkv", "rope_kv", "attention", "o", "gate_up", "act", "down", "other")


def decode_model_timers(reset: bool = False) -> tuple[dict[str, float], int]:
    """DecodeModel.forward's wall time per part (ms, summed over forwards: each part's parallel
    region fork and join included) and how many forwards were counted, since the last reset; `reset`
    zeroes them. Counted only when RADIXSERVE_DECODE_TIMERS is set before the first forward: "1"
    wall time, "cpu" the calling thread's CPU time (an older build or the variable unset: zeros)."""
    if not hasattr(_lib(), "decode_model_timers"):
        return dict.fromkeys(DECODE_MODEL_PARTS, 0.0), 0
    *ns, count = _lib().decode_model_timers(reset)
    return {name: t / 1e6 for name, t in zip(DECODE_MODEL_PARTS, ns)}, count


def step_team_stats() -> dict[str, int]:
    """The compiled decode step's thread team (csrc/cpu/thread_pool.h): `steps` that ran on it,
    parallel `regions` it ran, `worker_chunks` its workers (not the stepping thread) ran, and its
    `size` (0 before the first step); all zeros on a build without it."""
    names = ("steps", "regions", "worker_chunks", "size")
    if not hasattr(_lib(), "step_team_stats"):
        return dict.fromkeys(names, 0)
    return dict(zip(names, _lib().step_team_stats()))


@contextmanager
def step_team_held() -> Iterator[bool]:
    """Holds the decode step team (csrc/cpu/thread_pool.h) on this thread for the block: the fused
    stack and the greedy head's candidate pass run in one scope, the team hot through the Python
    between them. Yields whether it took the team (False: off, one thread, already held, or a build
    without it); the kernels' results are the same either way."""
    lib = _lib()
    took = bool(lib.step_team_enter()) if hasattr(lib, "step_team_enter") else False
    try:
        yield took
    finally:
        if took:
            lib.step_team_exit()


def step_team_probe(n: int, grain: int, throw_at: int = -1) -> list[tuple[int, int]]:
    """Test hook: the chunks (sorted) that rs::parallel_for(0, n, grain) runs inside a step team
    (at::parallel_for's with RADIXSERVE_STEP_TEAM=0); the chunk holding `throw_at` raises."""
    return [tuple(c) for c in _lib().step_team_probe(n, grain, throw_at)]


def shm_comm_available() -> bool:
    """Whether this build has `ShmComm` (shared-memory collectives; radixserve.distributed.shm_comm)."""
    return available() and hasattr(_ext, "ShmComm")


def shm_comm(
    path: str, rank: int, world_size: int, slot_bytes: int, create: bool, timeout_s: float
) -> object:
    """A `ShmComm` over the region file `path` (rank `rank` of `world_size`): with create, makes the
    file (it must not exist), else attaches to the one another rank made with the same world_size
    and slot_bytes (a positive multiple of 64). Methods: all_reduce_(t) (fp32/bf16, in place,
    bit-identical on every rank), all_gather(t) ([..., n] -> [..., world_size * n]), barrier(),
    close(); properties rank, world_size, slot_bytes, seq, closed, timeout_s (settable).
    Collectives raise RuntimeError when a peer exits or closes, or a wait passes timeout_s."""
    return _lib().ShmComm(path, rank, world_size, slot_bytes, create, timeout_s)
