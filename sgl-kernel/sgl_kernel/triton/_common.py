"""Small helpers shared by the Triton launchers (block sizes, dot precision)."""

from __future__ import annotations

import torch
import triton

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
