"""Builds the optional CPU extension `sgl_kernel._cpu` (paged decode attention and friends).

The extension is compiled against the installed torch, so install with
`pip install --no-build-isolation -e sgl-kernel` (what `make setup` does). It is optional: when
torch or a C++ compiler is missing the package still installs and radixserve falls back to its
pure-torch paths (`sgl_kernel.cpu.available()` says which).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent
TORCH_EXTENSION = "sgl_kernel._cpu"
PRECOMPILED = HERE / "csrc" / "cpu" / "precompiled.h"


def precompile_header(compile_args: list[str], pch_dir: Path) -> list[str]:
    """Builds `pch_dir/precompiled.h.gch` with the sources' own compile flags and returns the flags
    that force-include it. Rebuilt only when the header or the command changes, so an incremental
    build keeps it (and ninja keeps the objects). Any failure only costs time: the sources then
    parse the header itself."""
    import torch
    from torch.utils.cpp_extension import get_cxx_compiler

    pch_dir.mkdir(parents=True, exist_ok=True)
    header, gch = pch_dir / PRECOMPILED.name, pch_dir / (PRECOMPILED.name + ".gch")
    # A copy beside the .gch: GCC looks for `<header>.gch` next to the header it is told to include.
    if not header.exists() or header.read_bytes() != PRECOMPILED.read_bytes():
        header.write_bytes(PRECOMPILED.read_bytes())
    cmd = [get_cxx_compiler(), *compile_args, "-x", "c++-header", str(header), "-o", str(gch)]
    stamp = pch_dir / "command.txt"
    key = f"torch {torch.__version__}\n{shlex.join(cmd)}\n"
    current = gch.exists() and stamp.exists() and stamp.read_text() == key
    if not current or gch.stat().st_mtime < header.stat().st_mtime:
        print("sgl-kernel: precompiling", PRECOMPILED.name, flush=True)
        stamp.unlink(missing_ok=True)
        if subprocess.run(cmd).returncode != 0:
            print("sgl-kernel: precompiled header failed; every source parses it", file=sys.stderr)
            gch.unlink(missing_ok=True)
        else:
            stamp.write_text(key)
    return ["-Winvalid-pch", "-include", str(header)]


def cpu_extension() -> tuple[list, dict]:
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("sgl-kernel: torch not importable; skipping the CPU extension", file=sys.stderr)
        return [], {}
    # Built on the machine that runs it, so -march=native is safe; override for portable builds.
    arch = os.environ.get("SGL_KERNEL_CPU_ARCH_FLAGS", "-march=native").split()
    debug = os.environ.get("SGL_KERNEL_CPU_DEBUG_FLAGS", "-g0").split()
    sources = sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc" / "cpu").glob("*.cpp"))
    ext = CppExtension(
        TORCH_EXTENSION,
        sources,
        # -g0: Python's CFLAGS carry -g, and debug info for ATen's templates is ~30% of the build's
        # CPU time; the code is the same without it. SGL_KERNEL_CPU_DEBUG_FLAGS=-g brings it back.
        # -std as torch would add it (when absent), but before the precompiled header is built.
        extra_compile_args=["-O3", "-fopenmp", *arch, *debug, "-std=c++20"],
        # libgomp.so.1 resolves to the copy torch already loaded, so there is one OpenMP pool.
        extra_link_args=["-fopenmp"],
        optional=True,
    )
    # Ninja (installed by `make setup`) compiles the sources in parallel, MAX_JOBS at a time (torch's
    # default: every core); without it torch falls back to one source at a time, with a warning.
    base = BuildExtension.with_options(use_ninja=True)

    class BuildExt(base):  # type: ignore[misc, valid-type]
        def run(self) -> None:
            # The extension is optional, so a failed compile only warns: without this, the previous
            # build's module would stay in the source tree and be imported as if it were current.
            for stale in (HERE / "sgl_kernel").glob("_cpu*.so"):
                stale.unlink()
            super().run()

        def build_extensions(self) -> None:
            # torch's BuildExtension compiles every source of every extension as C++ (and with
            # ninja, through its own compile command): the plain C library is built first, by
            # setuptools' own build_ext, before torch takes over the compiler.
            from setuptools.command.build_ext import build_ext as plain_build_ext

            torch_exts = [e for e in self.extensions if e.name == TORCH_EXTENSION]
            for ext in self.extensions:
                if ext.name != TORCH_EXTENSION:
                    with self._filter_build_errors(ext):
                        plain_build_ext.build_extension(self, ext)
            all_exts, self.extensions = self.extensions, torch_exts
            try:
                super().build_extensions()
            finally:
                self.extensions = all_exts

        def build_extension(self, ext: object) -> None:
            ninja_compile = self.compiler.compile

            def compile_with_pch(
                sources: list,
                output_dir: str,
                macros: list,
                include_dirs: list,
                debug: int = 0,
                extra_preargs: list | None = None,
                extra_postargs: list | None = None,
                depends: list | None = None,
            ) -> list:
                # The flags torch's ninja compile gives every source (cpp_extension's
                # unix_wrap_ninja_compile), so that GCC accepts the precompiled header.
                _, _, postargs, pp_opts, _ = self.compiler._setup_compile(
                    output_dir, macros, include_dirs, sources, depends, extra_postargs
                )
                flags = [
                    *self.compiler.compiler_so[1:],
                    *self.compiler._get_cc_args(pp_opts, debug, extra_preargs),
                    *postargs,
                ]
                pch = precompile_header(flags, Path(os.path.abspath(output_dir)) / "pch")
                return ninja_compile(
                    sources,
                    output_dir,
                    macros,
                    include_dirs,
                    debug,
                    extra_preargs,
                    [*postargs, *pch],
                    depends,
                )

            if ext.name == TORCH_EXTENSION and isinstance(ext.extra_compile_args, list):
                self.compiler.compile = compile_with_pch
            try:
                super().build_extension(ext)
            except RuntimeError as exc:
                # torch's ninja path reports a failed compile as RuntimeError, which setuptools'
                # `optional=True` does not catch; as CompileError it warns and goes on, as before.
                from distutils.errors import CompileError

                raise CompileError(str(exc)) from exc
            finally:
                self.compiler.compile = ninja_compile

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
