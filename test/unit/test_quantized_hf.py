"""Pre-quantized HF checkpoints (GPTQ / AWQ int4, compressed-tensors W8A8 int8): the loader
against the test packer's own dequantization (radixserve.testing.quantized_checkpoints, written
from the formats' descriptions), the --quantization flag against the checkpoint, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.configs.checkpoint_quant import CheckpointQuant, parse_quantization_config
from radixserve.configs.model_config import ModelConfig
from radixserve.layers.linear import Linear
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.loader import load_model
from radixserve.server_args import ServerArgs
from radixserve.testing.quantized_checkpoints import write_quantized_checkpoint

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):
    """quantized(kind, method, group=32) -> (checkpoint folder, reference weights by HF name)."""
    made: dict[tuple[str, str, int], tuple[Path, dict[str, torch.Tensor]]] = {}

    def make(kind: str, method: str, group: int = 32) -> tuple[Path, dict[str, torch.Tensor]]:
        key = (kind, method, group)
        if key not in made:
            root = tmp_path_factory.mktemp(f"{kind}_{method}_{group}")
            refs = write_quantized_checkpoint(tiny_model_dir(kind), root / "q", root / "ref", method, group)
            made[key] = (root / "q", refs)
        return made[key]

    return make


def expected_weight(module_name: str, refs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fused layer's reference: its HF projections' dequantizations stacked by rows."""
    prefix, _, leaf = module_name.rpartition(".")
    parts = _FUSED.get(leaf, (leaf,))
    return torch.cat([refs[f"{prefix}.{p}.weight"] for p in parts])


def _decoder_linears(model: torch.nn.Module) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["gptq", "gptq_v2", "awq"])
def test_int4_checkpoints_load_exactly_as_the_packer_dequantizes(quantized, kind, method):
    path, refs = quantized(kind, method)
    config = ModelConfig.from_path(str(path))
    assert config.quantization is not None and config.quantization.method == method.removesuffix("_v2")
    model = load_model(config)
    linears = _decoder_linears(model)
    assert len(linears) == 4 * config.num_layers
    for name, layer in linears.items():
        wq = layer.weight_wq
        assert wq is not None and wq.bits == 4 and wq.group_size == 32, name
        expected = expected_weight(name, refs)
        # Bit-exact: the packer's s * (q - z) in fp32, both as the kernel form and as the fp32
        # weight that batches above WQ_MAX_TOKENS use.
        assert torch.equal(wq.dequantize(), expected), name
        assert torch.equal(layer.weight, expected), name
        assert layer.weight_int8 is None


@pytest.mark.parametrize(("method", "group"), [("awq", 64), ("gptq", -1), ("gptq_v2", -1)])
def test_other_group_sizes(quantized, method, group):
    path, refs = quantized("llama", method, group)  # the tiny model's linears are 64 and 128 inputs wide
    model = load_model(ModelConfig.from_path(str(path)))
    for name, layer in _decoder_linears(model).items():
        k = layer.weight.shape[1]
        assert layer.weight_wq.group_size == (k if group == -1 else group), name
        assert torch.equal(layer.weight_wq.dequantize(), expected_weight(name, refs)), name


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_compressed_tensors_w8a8_loads_into_the_w8a8_forms(quantized, kind):
    path, refs = quantized(kind, "w8a8")
    model = load_model(ModelConfig.from_path(str(path)))
    stored = load_file(str(path / "model.safetensors"))
    for name, layer in _decoder_linears(model).items():
        assert layer.weight_wq is None and layer.weight_int8.dtype == torch.int8, name
        expected = expected_weight(name, refs)
        assert torch.equal(layer.weight_int8.float() * layer.weight_scale[:, None], expected), name
        assert torch.equal(layer.weight, expected), name
        prefix, _, leaf = name.rpartition(".")
        first = f"{prefix}.{_FUSED.get(leaf, (leaf,))[0]}"
        rows = stored[first + ".weight"].shape[0]
        assert torch.equal(layer.weight_int8[:rows], stored[first + ".weight"])  # the checkpoint's bytes


def test_compressed_tensors_own_dequantization_agrees(quantized):
    """compressed-tensors (the library that writes these checkpoints) as an independent reference."""
    ct = pytest.importorskip("compressed_tensors", reason="pip install compressed-tensors to run this check")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    path, _ = quantized("llama", "w8a8")
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**config["config_groups"]["group_0"]["weights"])
    stored = load_file(str(path / "model.safetensors"))
    model = load_model(ModelConfig.from_path(str(path)))
    down = model.model.layers[1].mlp.down_proj
    prefix = "model.layers.1.mlp.down_proj"
    theirs = dequantize(stored[prefix + ".weight"], stored[prefix + ".weight_scale"].float(), args=args)
    assert ct is not None and torch.equal(down.weight, theirs.float())


def test_exactness_of_the_offset_form():
    """s * (q - z) == q * s + (-s * z) in fp32 for every fp16 s (normal and subnormal) and 4-bit
    q, z (z up to 16, GPTQ v1): the contract's claim, checked exhaustively over q and z."""
    s = torch.tensor([6.1e-5, 5.96e-8, 0.0123, 1.0, 3.5, 65504.0], dtype=torch.float16).float()
    q = torch.arange(16).float()
    for z in range(17):
        exact = s[:, None] * (q[None, :] - z)
        assert torch.equal(q[None, :] * s[:, None] + (-(s * z))[:, None], exact), z


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_the_checkpoint_selects_the_method_and_compatible_flags_are_accepted(quantized):
    gptq, _ = quantized("llama", "gptq")
    awq, _ = quantized("llama", "awq")
    w8a8, _ = quantized("llama", "w8a8")

    def resolve(path: Path, flag: str | None = None) -> str | None:
        return ServerArgs(model_path=str(path), quantization=flag).resolve().quantization

    assert resolve(gptq) == "gptq" and resolve(gptq, "gptq") == "gptq"
    assert resolve(gptq, "gptq_marlin") == "gptq"  # SGLang's GPU kernel name for the same checkpoint
    assert resolve(awq) == "awq" and resolve(awq, "awq_marlin") == "awq"
    assert resolve(w8a8) == "compressed-tensors"
    assert resolve(w8a8, "w8a8_int8") == "w8a8_int8"  # SGLang's compatible pair


@pytest.mark.parametrize(
    ("method", "flag", "message"),
    [
        (
            "gptq",
            "awq",
            "does not match the quantization method specified in the `quantization` argument (awq)",
        ),
        ("awq", "w8a8_int8", "model config (awq) does not match"),
        ("w8a8", "gptq", "model config (compressed-tensors) does not match"),
        ("gptq", "fp8", "model config (gptq) does not match"),
        ("gptq", "unquant", "model config (gptq) does not match"),  # SGLang's explicit "none"
    ],
)
def test_a_conflicting_flag_is_refused(quantized, method, flag, message):
    path, _ = quantized("llama", method)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ServerArgs(model_path=str(path), quantization=flag).resolve()


@pytest.mark.parametrize("flag", ["gptq", "awq", "compressed-tensors"])
def test_a_prequantized_flag_needs_a_prequantized_checkpoint(tiny_model_dir, flag):
    with pytest.raises(ValueError, match=f"--quantization {flag} loads a pre-quantized checkpoint"):
        ServerArgs(model_path=str(tiny_model_dir("llama")), quantization=flag).resolve()


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            {"quant_method": "gptq", "bits": 8, "group_size": 128},
            "8-bit weights are not supported: only 4-bit",
        ),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 40}, "group_size 40 is not supported"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "fp8"}, "quantized with 'fp8'"),
        ({"quant_method": "bitsandbytes"}, "radixserve loads GPTQ and AWQ int4"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {}}},
            "format 'pack-quantized'",
        ),
    ],
)
def test_unsupported_configs_are_refused_with_a_message(cfg, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(cfg)


def test_compressed_tensors_static_activations_are_refused():
    cfg = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {
            "group_0": {
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "channel",
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "tensor",
                    "dynamic": False,
                },
            }
        },
    }
    with pytest.raises(ValueError, match="activations int8 symmetric per tensor, static.*not supported"):
        parse_quantization_config(cfg)


def test_unsupported_bits_fail_at_startup_and_at_load(quantized, tmp_path):
    path = _copy(quantized("llama", "gptq")[0], tmp_path / "gptq8")
    _edit_config(path, bits=8)
    with pytest.raises(ValueError, match="only 4-bit"):
        ServerArgs(model_path=str(path)).resolve()
    with pytest.raises(ModelLoadError, match="only 4-bit"):
        ModelConfig.from_path(str(path))


def test_act_order_g_idx_is_refused_with_a_message(quantized, tmp_path):
    path = _copy(quantized("llama", "gptq")[0], tmp_path / "act_order")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()  # groups in a permuted input order
    save_file(tensors, str(path / "model.safetensors"))
    _edit_config(path, desc_act=True)
    with pytest.raises(ModelLoadError, match=r"down_proj\.g_idx .* desc_act"):
        load_model(ModelConfig.from_path(str(path)))


def test_a_fused_layer_mixing_quantized_and_plain_projections_is_refused(quantized, tiny_model_dir, tmp_path):
    path = _copy(quantized("llama", "awq")[0], tmp_path / "mixed")
    tensors = load_file(str(path / "model.safetensors"))
    prefix = "model.layers.0.self_attn.k_proj"
    for part in ("qweight", "qzeros", "scales"):
        del tensors[f"{prefix}.{part}"]
    tensors[prefix + ".weight"] = load_file(str(Path(tiny_model_dir("llama")) / "model.safetensors"))[
        prefix + ".weight"
    ]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="qkv_proj fuses quantized and unquantized projections"):
        load_model(ModelConfig.from_path(str(path)))


def test_a_checkpoint_without_quantized_tensors_is_refused(tiny_model_dir, tmp_path):
    path = _copy(Path(tiny_model_dir("llama")), tmp_path / "claims_gptq")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no tensor is stored that way"):
        load_model(ModelConfig.from_path(str(path)))


def test_describe():
    assert CheckpointQuant("gptq", 4, 128).describe() == "gptq int4 (group 128)"


def test_a_scales_tensor_of_the_wrong_shape_is_refused(quantized, tmp_path):
    path = _copy(quantized("llama", "awq")[0], tmp_path / "bad_scales")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.scales"
    tensors[name] = tensors[name][:, :-8].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"up_proj\.scales has shape \(2, 120\)"):
        load_model(ModelConfig.from_path(str(path)))


def test_autogptq_zero_biases_of_a_bias_free_model_are_dropped(quantized, tmp_path):
    path = _copy(quantized("llama", "gptq")[0], tmp_path / "zero_bias")
    tensors = load_file(str(path / "model.safetensors"))
    prefix = "model.layers.0.self_attn.q_proj"
    tensors[prefix + ".bias"] = torch.zeros(tensors[prefix + ".scales"].shape[1], dtype=torch.float16)
    save_file(tensors, str(path / "model.safetensors"))
    model = load_model(ModelConfig.from_path(str(path)))  # Llama has no q_proj bias: dropped
    assert model.model.layers[0].self_attn.qkv_proj.bias is None
    tensors[prefix + ".bias"][0] = 1.0
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"q_proj\.bias is not zero"):
        load_model(ModelConfig.from_path(str(path)))
