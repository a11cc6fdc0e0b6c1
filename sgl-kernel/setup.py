"""Builds the optional CPU extension `sgl_kernel._cpu` (paged decode attention and friends).

The extension is compiled against the installed torch, so install with
`pip install --no-build-isolation -e sgl-kernel` (what `make setup` does). It is optional: when
torch or a C++ compiler is missing the package still installs and radixserve falls back to its
pure-torch paths (`sgl_kernel.cpu.available()` says which).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent


def cpu_extension() -> tuple[list, dict]:
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("sgl-kernel: torch not importable; skipping the CPU extension", file=sys.stderr)
        return [], {}
    # Built on the machine that runs it, so -march=native is safe; override for portable builds.
    arch = os.environ.get("SGL_KERNEL_CPU_ARCH_FLAGS", "-march=native").split()
    sources = sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc" / "cpu").glob("*.cpp"))
    ext = CppExtension(
        "sgl_kernel._cpu",
        sources,
        extra_compile_args=["-O3", "-fopenmp", *arch],
        # libgomp.so.1 resolves to the copy torch already loaded, so there is one OpenMP pool.
        extra_link_args=["-fopenmp"],
        optional=True,
    )
    base = BuildExtension.with_options(use_ninja=False)

    class BuildExt(base):  # type: ignore[misc, valid-type]
        def run(self) -> None:
            # The extension is optional, so a failed compile only warns: without this, the previous
            # build's module would stay in the source tree and be imported as if it were current.
            for stale in (HERE / "sgl_kernel").glob("_cpu*.so"):
                stale.unlink()
            super().run()

    return [ext], {"build_ext": BuildExt}


def spin_calibration_library() -> list:
    """`sgl_kernel/_spin_calibration*.so`: a plain C library (no Python API, no torch) that
    radixserve loads with ctypes before torch, to give OpenMP's spin-wait in time (csrc/spin)."""
    from setuptools import Extension

    return [
        Extension(
            "sgl_kernel._spin_calibration",
            ["csrc/spin/spin_calibration.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]


ext_modules, cmdclass = cpu_extension()
setup(ext_modules=ext_modules + spin_calibration_library(), cmdclass=cmdclass)
