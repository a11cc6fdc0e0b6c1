"""Whether a layer takes sgl-kernel's compiled CPU path (layers keep their torch code as the
reference the kernels are tested against, and as the path everywhere else: GPU, non-fp32 dtypes,
or an install where the extension was not built).

Decided once at import; RADIXSERVE_DISABLE_CPU_KERNELS=1 (read by sgl_kernel.cpu) turns every
compiled path off for A/B runs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

try:
    from sgl_kernel import cpu as cpu_kernels
except ImportError:  # sgl-kernel not installed: the torch paths are used
    cpu_kernels = None  # type: ignore[assignment]

ENABLED = cpu_kernels is not None and cpu_kernels.available()


def fusable(*tensors: torch.Tensor) -> bool:
    """True when the compiled CPU kernels can take these tensors (all fp32, on the CPU)."""
    return ENABLED and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def step_team(on: bool) -> AbstractContextManager[bool]:
    """The decode step team held for a block when `on` (sgl_kernel.cpu.step_team_held: the fused
    stack and the LM head in one scope); a no-op where off or the build lacks it."""
    if not on or not ENABLED or not hasattr(cpu_kernels, "step_team_held"):
        return nullcontext(False)
    return cpu_kernels.step_team_held()
