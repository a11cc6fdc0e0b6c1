"""Every engine held to the AVX2 paths on a CPU that has more (`compare_peers.py --isa avx2`).

Issue 40 asks for the five cells on every CPU class, AVX2-only machines included, and a session
does not choose its machine. On an AVX-512 machine the AVX2 class is measured by forcing each
engine onto the code it would run there, all of them in the same run:

- radixserve: sgl-kernel built with `-mavx2 -mfma -mf16c` (cached per source, below) ahead of the
  installed one on PYTHONPATH; torch's kernels (`ATEN_CPU_CAPABILITY=avx2`) and oneDNN's
  (`ONEDNN_MAX_CPU_ISA=AVX2`) held to AVX2 in every process of the server.
- llama-server: a second build with `GGML_NATIVE=OFF` and AVX/AVX2/FMA/F16C/BMI2 on (llama_cpp.py).
- vLLM's CPU backend: the same torch/oneDNN variables, and its shim (vllm_cpu.py) answers torch's
  AVX-512 queries with False, so vLLM loads its `_C_AVX2` kernels and picks its AVX2 attention, as
  it does on an AVX2-only CPU.

What stays: the caches, the memory bandwidth and the clock of the machine the run is on — the
forced run tells how the AVX2 code paths compare, not what an AVX2-only machine would measure.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ISAS = ("native", "avx2")
AVX2_ARCH_FLAGS = "-mavx2 -mfma -mf16c"
# Read by the vLLM shim (vllm_cpu.SHIM) in every process the server spawns.
PEER_ISA_VAR = "RADIXSERVE_PEER_ISA"


def engine_env(isa: str) -> dict[str, str]:
    """Environment every engine's server starts with under `isa` (empty for the native paths)."""
    if isa == "native":
        return {}
    if isa != "avx2":
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    return {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", PEER_ISA_VAR: "avx2"}


def _source_digest(kernel_src: Path) -> str:
    """A digest of the files a kernel build reads, so an edited source gets a fresh build."""
    h = hashlib.sha256()
    for path in sorted(kernel_src.rglob("*")):
        rel = path.relative_to(kernel_src)
        if path.is_file() and rel.parts[0] in ("csrc", "sgl_kernel", "setup.py", "pyproject.toml"):
            if path.suffix in (".so", ".pyc") or "__pycache__" in rel.parts:
                continue
            h.update(str(rel).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def avx2_kernel(kernel_src: Path, cache: Path) -> Path:
    """A directory to put first on PYTHONPATH: `kernel_src` (the repo's sgl-kernel) built for AVX2
    (+FMA, F16C) in a copy under `cache`, once per source digest (~3 min on 2 cores)."""
    target = cache / f"sgl-kernel-avx2-{_source_digest(kernel_src)}"
    stamp = target / ".radixserve-ready"
    if stamp.exists():
        return target
    if target.exists():  # an interrupted build
        shutil.rmtree(target)
    ignore = shutil.ignore_patterns("build", "*.so", "__pycache__", "*.egg-info")
    shutil.copytree(kernel_src, target, ignore=ignore)
    log = cache / f"{target.name}.log"
    print(f"[isa] building sgl-kernel for AVX2 into {target} (~3 min; log {log})", file=sys.stderr)
    env = {**os.environ, "SGL_KERNEL_CPU_ARCH_FLAGS": AVX2_ARCH_FLAGS}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    with open(log, "wb") as out:
        cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
        rc = subprocess.call(cmd, cwd=target, env=env, stdout=out, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"the AVX2 sgl-kernel build failed (exit {rc}); log {log}")
    check = "from sgl_kernel import cpu; print(','.join(cpu.linear_wq_isas()))"
    isas = subprocess.run(
        [sys.executable, "-c", check],
        cwd=target,
        env={**env, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if "avx512" in isas.split(",") or "avx2" not in isas.split(","):
        raise RuntimeError(f"the sgl-kernel build in {target} is not an AVX2 one: linear_wq paths {isas}")
    stamp.touch()
    return target
