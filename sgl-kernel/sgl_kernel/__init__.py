"""radixserve's kernel package.

Importing `sgl_kernel` never imports triton or touches CUDA: the Triton kernels live in
`sgl_kernel.triton.*` and are imported by the attention backend only when it is selected. Use
`triton_available()` to decide whether those modules can be imported at all.
"""

from __future__ import annotations

import importlib.util
import os

__version__ = "0.1.0"


def triton_available() -> bool:
    """True when the `triton` package is installed (kernels then run on a GPU, or on CPU under
    TRITON_INTERPRET=1). Does not import triton."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


__all__ = ["__version__", "interpreter_enabled", "triton_available"]
