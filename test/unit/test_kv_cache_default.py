"""What --kv-cache-dtype auto stores (configs/kv_cache_args.py): bf16 for a quantized model in fp32
math on CPU (the built-in model's GGUF default included), the model dtype otherwise; float32 is the
explicit exact spelling."""

from __future__ import annotations

import logging

import pytest
import torch

from radixserve.layers import group_quant
from radixserve.mem_cache.kv_dtype import kv_storage_dtype
from radixserve.server_args import ServerArgs

LOGGER = "radixserve.configs.kv_cache_args"


@pytest.fixture(autouse=True)
def with_wq_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in model resolves to gguf as on a build with linear_wq."""
    monkeypatch.setattr(group_quant, "WQ_KERNEL", True)


def _resolve(**kwargs: object) -> ServerArgs:
    return ServerArgs(**{"device": "cpu", **kwargs}).resolve()


def test_builtin_gguf_default_stores_bf16_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        args = _resolve()
    assert args.quantization == "gguf"
    assert args.kv_cache_dtype == "bf16"
    assert "--kv-cache-dtype float32 keeps fp32 K/V" in caplog.text
    assert kv_storage_dtype(args.kv_cache_dtype, torch.float32) == torch.bfloat16


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"quantization": "unquant"}, "auto"),  # the fp32 model: exact K/V
        ({"kv_cache_dtype": "float32"}, "float32"),  # asked for by name
        ({"kv_cache_dtype": "int8"}, "int8"),
        ({"attention_backend": "torch_native"}, "bf16"),  # reads every pool dtype
        ({"dtype": "bfloat16"}, "auto"),  # not fp32 math: the model dtype, as SGLang
    ],
)
def test_auto_elsewhere_and_explicit_values(flags: dict, expected: str) -> None:
    assert _resolve(**flags).kv_cache_dtype == expected


def test_float32_is_the_fp32_pool_and_needs_an_fp32_model() -> None:
    assert kv_storage_dtype("float32", torch.float32) == torch.float32
    with pytest.raises(ValueError, match="float32"):
        _resolve(kv_cache_dtype="float32", dtype="bfloat16", quantization="unquant")
