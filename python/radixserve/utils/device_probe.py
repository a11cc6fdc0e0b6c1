"""The default device and CPU attention backend, decided without importing torch where possible.

`ServerArgs.resolve` runs in the server's main process before any child starts, so whatever it
imports delays every start. Importing torch to ask `torch.cuda.is_available()` cost ~2 s of CPU
there (5-6 s on a loaded 2-core machine), for an answer a CPU-only torch build gives from its
generated `torch/version.py` (`cuda` and `hip` are None in such a build). A GPU build is
still asked through torch, which also knows whether a device is present. Likewise sgl-kernel's
compiled CPU extension is found without loading it (loading it imports torch); the scheduler loads
it and refuses to start with a clear message when a found build cannot be loaded (CpuAttnBackend).
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

# torch/version.py's names that are set (not None) in a build torch.cuda can use: CUDA, ROCm.
_GPU_BUILD_FIELDS = ("cuda", "hip")


def default_device() -> str:
    """ "cuda" when torch sees a CUDA (or ROCm) device, else "cpu"."""
    if not torch_has_gpu_build():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_has_gpu_build() -> bool:
    """False only when the installed torch's version.py says it was built without CUDA and ROCm;
    anything unexpected (no file, another layout) answers True, so torch is asked."""
    package = _torch_package_dir()
    if package is None:
        return True
    try:
        fields = build_fields((package / "version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return True
    if not all(name in fields for name in _GPU_BUILD_FIELDS):
        return True
    return any(fields[name] is not None for name in _GPU_BUILD_FIELDS)


def _torch_package_dir() -> Path | None:
    """The installed torch package's folder, found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def build_fields(source: str) -> dict[str, object]:
    """The module-level constants of a torch/version.py (`cuda: Optional[str] = None`, ...)."""
    fields: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            fields[node.target.id] = ast.literal_eval(node.value)
        elif (
            isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        ):
            try:
                fields[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:  # a computed value (not one of the build fields)
                continue
    return fields


def default_cpu_attention_backend() -> str:
    """ "cpu" (sgl-kernel's compiled decode and extend) when the extension is built and not turned
    off (RADIXSERVE_DISABLE_CPU_KERNELS, as sgl_kernel.cpu.available() reads it), else
    "torch_native"."""
    if os.environ.get("RADIXSERVE_DISABLE_CPU_KERNELS", "0") not in ("", "0"):
        return "torch_native"
    try:
        built = importlib.util.find_spec("sgl_kernel._cpu") is not None
    except ImportError:  # sgl-kernel not installed at all
        built = False
    return "cpu" if built else "torch_native"
