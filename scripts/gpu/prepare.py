"""Prepare what the GPU checks carry to the device machine (run here, where pip reaches PyPI).

    .venv/bin/python scripts/gpu/prepare.py            # -> .whl/ and .gpu_models/ (both git-ignored)
    .venv/bin/python scripts/gpu/prepare.py --flashinfer   # -> .whl_fi/ as well (see below)

The device machine has Python 3.12, torch 2.11, triton 3.6, transformers and the scientific stack, no
network. radixserve's other runtime and test dependencies travel as cp312 wheels of the versions
this venv runs (the tested ones): the closure of pyproject's dependencies and test extra, minus
the large packages the machine already has (BOX_HAS).

flashinfer: 0.7's wheel (62 MB) with the packages it requires (cudnn-frontend, cuda-tile,
tvm-ffi) is 74 MiB, over the 64 MiB a call may carry. 0.6.0 is a 7.5 MB JIT wheel (its kernels
compile with the machine's nvcc on first use) whose `import flashinfer` needs only apache-tvm-ffi
beyond what the machine has (checked here: the prefill/decode wrappers import without
cudnn-frontend or cutlass-dsl, which only other kernels use), so that is what travels: ~11 MiB.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
ROOTS = [
    "pyzmq", "fastapi", "uvicorn", "uvloop", "orjson", "pydantic", "xgrammar", "gguf",
    "openai", "jsonschema", "msgspec", "pytest-timeout", "typing-extensions",
    "py-spy",  # profile_serving.py samples the scheduler with it (run_checks.sh lease serving_profile)
]  # fmt: skip
# Already on the device machine (its KINDS.md list) and large or compiled: never carried.
BOX_HAS = {
    "torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "huggingface-hub",
    "hf-xet", "jinja2", "markupsafe", "pyyaml", "regex", "requests", "urllib3", "certifi", "idna",
    "charset-normalizer", "aiohttp", "aiosignal", "frozenlist", "multidict", "yarl", "propcache",
    "aiohappyeyeballs", "attrs", "psutil", "tqdm", "pytest", "pluggy", "iniconfig", "packaging",
    "filelock", "fsspec", "sympy", "mpmath", "networkx", "setuptools", "click", "h11", "pygments",
    "uvloop", "zipp", "six",
}  # fmt: skip
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """name -> installed version for `roots` and everything they need here (extras ignored)."""
    seen: dict[str, str] = {}
    todo = [norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in BOX_HAS or name.startswith(("nvidia-", "cuda-")):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # not needed on this platform / Python
        seen[name] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": "", "python_version": "3.12"}):
                todo.append(norm(req.name))
    return seen


def download(pins: list[str], dest: Path) -> None:
    dest.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + pins, check=True)


def ignore(path: str) -> None:
    exclude = ROOT / ".git" / "info" / "exclude"
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    if f"/{path}/" not in lines:
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text("\n".join([*lines, f"/{path}/"]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flashinfer", default=None, nargs="?", const="flashinfer-python==0.6.0",
                        help="also fetch this flashinfer requirement and its needs into .whl_fi/")  # fmt: skip
    args = parser.parse_args()
    for path in (".whl", ".whl_fi", ".gpu_models"):
        ignore(path)
    pins = [f"{n}=={v}" for n, v in sorted(closure(ROOTS).items())]
    print("carrying:", " ".join(pins))
    download(pins, ROOT / ".whl")
    if args.flashinfer:
        download([args.flashinfer, "apache-tvm-ffi<0.2"], ROOT / ".whl_fi")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmark" / "bench_gpu.py"),
            "make-models",
            "--out",
            str(ROOT / ".gpu_models"),
        ],
        check=True,
    )
    for folder in (".whl", ".whl_fi", ".gpu_models"):
        path = ROOT / folder
        if path.exists():
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            print(f"{folder}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
