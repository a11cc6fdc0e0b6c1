"""llama.cpp's `llama-server`, built from source once into the cache, and GGUFs of the built-in model.

The C++ source comes from the PyPI sdist of llama-cpp-python (`vendor/llama.cpp`), since PyPI is
the one registry every setup of this project reaches. Everything lands under
`<cache root>/peers/` (`~/.cache/radixserve/peers/` by default) and each step is skipped when its
output is already there:

    llama_cpp_python-<version>/vendor/llama.cpp/          the source tree
    llama_cpp_python-<version>/vendor/llama.cpp/build/    the CMake build (bin/llama-server)
    build-llama-server-<version>.log                      configure + build output
    gguf/<model>-<f32|f16|q8_0>.gguf                      convert_hf_to_gguf.py output

First use costs a ~75 MB download and ~10 minutes of compiling on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from radixserve.model_loader.default_model import cache_root

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
GGUF_OUTTYPES = ("f32", "f16", "q8_0")
# The built-in model's own file: llama-server serves it as it is (no conversion).
SOURCE_OUTTYPE = "q4_1"
CTX_SIZE = 32768  # llama-server -c: the KV cache of all slots together
CMAKE_CONFIGURE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
# Per ISA (peers/isa.py): the build directory and the flags that replace -DGGML_NATIVE=ON. The
# AVX2 build is what llama.cpp's own CMake enables on an AVX2-only host (AVX-512 stays off).
BUILDS = {
    "native": ("build", ()),
    "avx2": (
        "build-avx2",
        (
            "-DGGML_NATIVE=OFF",
            "-DGGML_AVX=ON",
            "-DGGML_AVX2=ON",
            "-DGGML_FMA=ON",
            "-DGGML_F16C=ON",
            "-DGGML_BMI2=ON",
        ),
    ),
}


class PeerSetupError(RuntimeError):
    """A prerequisite is missing or a fetch/build/convert step failed; the message says what to do."""


def peers_dir() -> Path:
    return cache_root() / "peers"


def source_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return peers_dir() / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def server_binary(version: str = LLAMA_CPP_PYTHON_VERSION, isa: str = "native") -> Path:
    return source_dir(version) / BUILDS[isa][0] / "bin" / "llama-server"


def gguf_path(model_dir: Path, outtype: str) -> Path:
    return peers_dir() / "gguf" / f"{model_dir.name}-{outtype}.gguf"


def _run_logged(
    cmd: list[str], log_path: Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> None:
    """Run `cmd` with its output appended to `log_path`; raise PeerSetupError quoting the log on failure."""
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise PeerSetupError(f"`{' '.join(cmd)}` failed with exit code {rc}; log {log_path}:\n{tail}")


def fetch_source(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The llama.cpp source tree, downloaded and unpacked from the llama-cpp-python sdist if missing."""
    src = source_dir(version)
    if (src / "CMakeLists.txt").is_file() and (src / "convert_hf_to_gguf.py").is_file():
        return src
    root = peers_dir()
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / f"fetch-llama-cpp-python-{version}.log"
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        download = [
            *(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"),
            *(f"llama-cpp-python=={version}", "-d", tmp),
        ]
        print(
            f"[llama.cpp] downloading the llama-cpp-python {version} sdist (log {log_path})", file=sys.stderr
        )
        _run_logged(download, log_path)
        archives = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise PeerSetupError(f"pip download left no llama_cpp_python sdist in {tmp}; log {log_path}")
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(archives[0]) as tar:
            tar.extractall(unpacked, filter="data")
        tree = unpacked / f"llama_cpp_python-{version}"
        if not (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            raise PeerSetupError(f"the sdist {archives[0].name} has no vendor/llama.cpp tree")
        target = src.parent.parent
        if target.exists():  # a half-written tree from an interrupted run
            shutil.rmtree(target)
        os.rename(tree, target)  # atomic: a tree that exists is complete
    return src


def check_build_tools() -> None:
    """Raise PeerSetupError naming what to install when cmake or a C/C++ compiler is missing."""
    missing = [tool for tool in ("cmake",) if shutil.which(tool) is None]
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        missing.append("a C compiler (gcc or clang)")
    if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    if missing:
        raise PeerSetupError(
            "building llama-server needs "
            + ", ".join(missing)
            + " (Debian/Ubuntu: apt-get install cmake g++; macOS: xcode-select --install && brew install cmake)"
        )


def build_server(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2, isa: str = "native") -> Path:
    """Path of a built `llama-server` for `isa` (BUILDS), fetching and compiling it first if it is
    not in the cache."""
    binary = server_binary(version, isa)
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    check_build_tools()
    src = fetch_source(version)
    build_dir, isa_flags = BUILDS[isa]
    suffix = "" if isa == "native" else f"-{isa}"
    log_path = peers_dir() / f"build-llama-server-{version}{suffix}.log"
    print(
        f"[llama.cpp] building llama-server ({isa}) with {jobs} jobs (~10 min on 2 cores; log {log_path})",
        file=sys.stderr,
    )
    configure = [f for f in CMAKE_CONFIGURE_FLAGS if not (isa_flags and f.startswith("-DGGML_NATIVE="))]
    _run_logged(["cmake", "-B", build_dir, *configure, *isa_flags], log_path, cwd=src)
    _run_logged(["cmake", "--build", build_dir, f"-j{jobs}", "--target", "llama-server"], log_path, cwd=src)
    if not binary.is_file():
        raise PeerSetupError(f"the build finished but {binary} is missing; log {log_path}")
    return binary


def server_version(binary: Path) -> str:
    """`llama-server --version` reduced to its "version: ..." line (it prints to stderr)."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = (out.stdout + out.stderr).splitlines()
    found = [line.strip() for line in lines if line.strip().startswith("version")]
    return found[0] if found else (lines[0].strip() if lines else "unknown")


def convert_gguf(model_dir: Path, outtype: str, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """A GGUF of the HF folder `model_dir` in `outtype` (f32/f16/q8_0), made by llama.cpp's converter
    once; q4_1 is the built-in model's own file (the one radixserve's fp32 weights come from)."""
    if outtype == SOURCE_OUTTYPE:
        from radixserve.model_loader.default_model import find_default_gguf

        return Path(find_default_gguf())
    if outtype not in GGUF_OUTTYPES:
        raise ValueError(f"outtype must be one of {GGUF_OUTTYPES}, got {outtype!r}")
    out = gguf_path(model_dir, outtype)
    if out.is_file():
        return out
    src = fetch_source(version)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f"convert-{out.stem}.log"
    tmp = out.with_name(f".{out.name}.tmp")
    # The converter must use the gguf-py of its own tree, not whichever gguf is installed.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(src / "gguf-py"), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir)]
    cmd += ["--outtype", outtype, "--outfile", str(tmp)]
    print(f"[llama.cpp] converting {model_dir.name} to {outtype} GGUF (log {log_path})", file=sys.stderr)
    try:
        _run_logged(cmd, log_path, env=env)
        os.rename(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def server_command(
    binary: Path,
    gguf: Path,
    port: int,
    threads: int = 2,
    ctx_size: int = CTX_SIZE,
    parallel: int = 64,
    host: str = "127.0.0.1",
) -> list[str]:
    """The llama-server command line: continuous batching over `parallel` slots of ctx_size/parallel.

    The KV cache is split per slot (no -kvu), so a prompt + output must fit in ctx_size / parallel.
    """
    return [
        str(binary),
        *("-m", str(gguf)),
        *("-t", str(threads), "-tb", str(threads)),
        *("-c", str(ctx_size), "-np", str(parallel), "-cb"),
        *("-b", "2048", "-ub", "512"),
        "--no-webui",
        *("--host", host, "--port", str(port)),
    ]
