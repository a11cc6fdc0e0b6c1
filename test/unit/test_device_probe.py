"""The default device and CPU attention backend, probed without torch (utils/device_probe.py),
against what torch and sgl_kernel.cpu answer when imported (the reference), and the start-up
path they serve: resolving a server's arguments imports no torch on a CPU-only build."""

from __future__ import annotations

import pytest
import torch
from fresh_interpreter import probe_json

from radixserve.utils import device_probe

CPU_BUILD = """from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = '2.13.0+cpu'
debug = False
cuda: Optional[str] = None
git_version = 'cf30153c4c131c8164ee7798e5022d810682e2cb'
hip: Optional[str] = None
rocm: Optional[str] = None
xpu: Optional[str] = None
"""
CUDA_BUILD = CPU_BUILD.replace("2.13.0+cpu", "2.13.0+cu130").replace(
    "cuda: Optional[str] = None", "cuda = '13.0'"
)
ROCM_BUILD = CPU_BUILD.replace("hip: Optional[str] = None", "hip: Optional[str] = '6.4.1'")


def test_build_fields_reads_both_assignment_forms():
    assert device_probe.build_fields(CPU_BUILD)["cuda"] is None
    assert device_probe.build_fields(CUDA_BUILD)["cuda"] == "13.0"
    assert device_probe.build_fields(ROCM_BUILD)["hip"] == "6.4.1"
    assert device_probe.build_fields("import os\nx = os.getcwd()\ncuda = None\n") == {"cuda": None}


@pytest.mark.parametrize(
    "source, gpu",
    [
        (CPU_BUILD, False),
        (CUDA_BUILD, True),
        (ROCM_BUILD, True),
        ("cuda = None\n", True),
        ("cuda = (\n", True),
    ],
    ids=["cpu", "cuda", "rocm", "no-hip-field", "unparsable"],
)
def test_an_unclear_version_file_asks_torch(tmp_path, monkeypatch, source: str, gpu: bool):
    """Only a version.py that says CPU-only skips torch; a missing field or a broken file asks it."""
    (tmp_path / "version.py").write_text(source)
    monkeypatch.setattr(device_probe, "_torch_package_dir", lambda: tmp_path)
    assert device_probe.torch_has_gpu_build() is gpu
    monkeypatch.setattr(device_probe, "_torch_package_dir", lambda: None)  # torch not found by spec
    assert device_probe.torch_has_gpu_build() is True


def test_probes_agree_with_torch_and_sgl_kernel(monkeypatch):
    """The reference: what the installed torch and sgl_kernel.cpu say once imported."""
    assert device_probe.torch_has_gpu_build() == (
        torch.version.cuda is not None or torch.version.hip is not None
    )
    assert device_probe.default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        from sgl_kernel import cpu as cpu_kernels
    except ImportError:
        built = False
    else:
        built = cpu_kernels.available()
    monkeypatch.delenv("RADIXSERVE_DISABLE_CPU_KERNELS", raising=False)
    assert device_probe.default_cpu_attention_backend() == ("cpu" if built else "torch_native")
    monkeypatch.setenv("RADIXSERVE_DISABLE_CPU_KERNELS", "1")
    assert device_probe.default_cpu_attention_backend() == "torch_native"


RESOLVE_PROBE = """
import json, sys
from radixserve.server_args import ServerArgs
args = ServerArgs(model_path=sys.argv[1]).resolve()
print(json.dumps({"device": args.device, "backend": args.attention_backend, "torch": "torch" in sys.modules}))
"""


@pytest.mark.skipif(device_probe.torch_has_gpu_build(), reason="a GPU build of torch is asked through torch")
def test_resolving_a_server_imports_no_torch_on_a_cpu_build(tiny_llama_path: str):
    """The server's main process resolves its arguments before any child starts: no torch there."""
    got = probe_json(RESOLVE_PROBE, tiny_llama_path)
    assert got["device"] == "cpu"
    assert got["backend"] == device_probe.default_cpu_attention_backend()
    assert got["torch"] is False
