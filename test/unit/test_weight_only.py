"""On-the-fly weight-only quantization (--torchao-config int8wo / int4wo-<g>) and the server
arguments of the weight-only modes (--torchao-config, --quantization gguf, GGUF model paths)."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.weight_only import (
    parse_torchao_config,
    quantize_int4wo,
    quantize_int8_groups,
    quantize_int8wo,
    quantize_weight_only,
)
from radixserve.model_loader import gguf_source
from radixserve.server_args import ServerArgs, prepare_server_args


def test_int8wo_is_symmetric_per_channel_within_half_a_step() -> None:
    w = torch.randn(48, 128) * torch.linspace(0.1, 3.0, 48)[:, None]
    form = quantize_int8wo(w)
    assert (form.bits, form.group_size, form.offsets) == (8, 128, None)
    scale = w.abs().amax(dim=1) / 127
    torch.testing.assert_close(form.scales[:, 0], scale)
    err = (form.dequantize() - w).abs()
    assert (err <= scale[:, None] * 0.5 * (1 + 1e-5)).all()
    assert form.integers().abs().max() == 127  # each row's largest weight takes the whole range


def test_int8_groups_are_symmetric_per_group_within_half_a_step() -> None:
    # w8a8_int8's LM head form: GGUF Q8_0's layout (int8, one scale per 32 inputs, no offset).
    w = torch.randn(40, 96) * torch.linspace(0.1, 3.0, 96)  # groups of different ranges
    w[5] = 0.0  # an all-zero row: scale 0, exactly zero
    form = quantize_int8_groups(w, 32)
    assert (form.bits, form.group_size, form.offsets, form.scales.shape) == (8, 32, None, (40, 3))
    scale = w.reshape(40, 3, 32).abs().amax(-1) / 127
    torch.testing.assert_close(form.scales, scale)
    err = (form.dequantize() - w).reshape(40, 3, 32).abs()
    assert (err <= scale[..., None] * 0.5 * (1 + 1e-5)).all()
    assert torch.equal(form.dequantize()[5], w[5])
    # A weight already on such a grid (a GGUF Q8_0 tensor dequantized) comes back exactly.
    again = quantize_int8_groups(form.dequantize(), 32)
    assert torch.equal(again.dequantize(), form.dequantize())


def test_int4wo_is_asymmetric_per_group_within_half_a_step() -> None:
    w = torch.randn(16, 256) + torch.linspace(-2, 2, 256)  # groups of different ranges and centres
    w[3, 64:96] = 0.25  # a constant group: scale 0, exactly its value
    form = quantize_int4wo(w, 32)
    assert (form.bits, form.group_size, form.scales.shape) == (4, 32, (16, 8))
    groups = w.reshape(16, 8, 32)
    torch.testing.assert_close(form.offsets, groups.amin(-1))  # offset = the group's min, exactly
    torch.testing.assert_close(form.scales, (groups.amax(-1) - groups.amin(-1)) / 15)
    deq = form.dequantize()
    q = form.integers()
    assert q.min() == 0 and q.max() == 15
    err = (deq - w).reshape(16, 8, 32).abs()
    assert (err <= form.scales[..., None] * 0.5 + 1e-6).all()
    assert torch.equal(deq[3, 64:96], w[3, 64:96])


def test_round_half_to_even() -> None:
    # min 0, max 15: scale 1, so w = 2.5 and 3.5 sit exactly halfway and round to 2 and 4.
    w = torch.tensor([[0.0, 15.0, 2.5, 3.5] + [0.0] * 28])
    assert quantize_int4wo(w, 32).integers()[0, :4].tolist() == [0, 15, 2, 4]


def test_group_size_that_does_not_divide_leaves_the_layer_unquantized() -> None:
    assert quantize_weight_only(torch.randn(8, 576), 4, 128) is None  # torchao's rule
    assert quantize_weight_only(torch.randn(8, 576), 4, 64) is not None
    assert quantize_weight_only(torch.randn(8, 576), 8, None) is not None


@pytest.mark.parametrize(
    "config, expected",
    [("int8wo", (8, None)), ("int4wo-32", (4, 32)), ("int4wo-128", (4, 128)), ("int4wo-256", (4, 256))],
)
def test_supported_torchao_configs(config: str, expected: tuple) -> None:
    assert parse_torchao_config(config) == expected
    assert (
        prepare_server_args(["--torchao-config", config, "--device", "cpu"]).resolve().torchao_config
        == config
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"torchao_config": "int8dq"},
            "int8dq is not implemented by radixserve; supported: int8wo, int4wo-32",
        ),
        ({"torchao_config": "fp8wo"}, "fp8wo is not implemented by radixserve"),
        ({"torchao_config": "fp8dq-per_row"}, "fp8dq-per_row is not implemented by radixserve"),
        ({"torchao_config": "int4wo-100"}, "group size must be one of"),
        ({"torchao_config": "int4"}, "not a torchao config SGLang defines; supported: int8wo"),
        ({"torchao_config": "int8wo", "quantization": "w8a8_int8"}, "does not combine with --quantization"),
        ({"torchao_config": "int8wo", "device": "cuda"}, "CPU only"),
        ({"torchao_config": "int8wo", "dtype": "bfloat16"}, "drop --dtype bfloat16"),
        ({"torchao_config": "int8wo", "is_embedding": True}, "generation models"),
        ({"quantization": "gguf", "dtype": "float16"}, "drop --dtype float16"),
        ({"quantization": "gguf", "load_format": "dummy"}, "drop --load-format dummy"),
        ({"load_format": "gguf", "model_path": "/nonexistent/model"}, "--load-format gguf needs"),
    ],
)
def test_weight_only_args_are_checked_at_start(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs(**{"device": "cpu", **kwargs}).resolve()


def test_a_gguf_model_path_selects_gguf_as_sglang_does(tmp_path, monkeypatch) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    # resolve() also converts the file into the folder it loads: not this stand-in's business.
    monkeypatch.setattr(gguf_source, "ensure_gguf_converted", lambda p: f"{p}.converted")
    args = ServerArgs(device="cpu", model_path=str(path)).resolve()
    assert (args.quantization, args.load_format) == ("gguf", "gguf")
    # Asking for no quantization serves the file dequantized to fp32; a torchao config quantizes that.
    args = ServerArgs(device="cpu", model_path=str(path), quantization="unquant").resolve()
    assert (args.quantization, args.load_format) == (None, "gguf")
    args = ServerArgs(device="cpu", model_path=str(path), torchao_config="int8wo").resolve()
    assert (args.quantization, args.load_format) == (None, "gguf")
    # Not a GGUF file (no magic): left alone.
    other = tmp_path / "m2.gguf"
    other.write_bytes(b"nope")
    assert ServerArgs(device="cpu", model_path=str(other)).resolve().quantization is None
