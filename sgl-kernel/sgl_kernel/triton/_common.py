"""Small helpers shared by the Triton kernels and launchers (online softmax, block sizes, dot precision)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel import interpreter_enabled


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision. fp32 inputs would default to TF32 on GPUs (10-bit mantissa), which
    breaks parity with the fp32 torch oracle, so fp32 asks for IEEE; bf16/fp16 ignore the flag."""
    return "ieee" if dtype == torch.float32 else "tf32"


def on_interpreter(t: torch.Tensor) -> bool:
    """Kernels run in the CPU interpreter: pick tiny blocks there (its cost is per element)."""
    return interpreter_enabled() or t.device.type != "cuda"


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels address rows by stride but assume unit stride inside a head."""
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def online_softmax_update(qk, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):  # noqa: ANN001, ANN202, N803 - Triton reads annotations
    """Fold one tile into flash attention's running state.

    qk [BLOCK_M, BLOCK_N]: masked scores in log2 units (-inf where hidden); v [BLOCK_N, D];
    m_i / l_i [BLOCK_M]: running max and sum of exp2; acc [BLOCK_M, D]: unnormalized output.
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
