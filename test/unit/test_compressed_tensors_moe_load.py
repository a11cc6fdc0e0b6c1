"""compressed-tensors W8A8 int8 MoE checkpoints (llm-compressor's Qwen3-MoE / Mixtral recipes): the
routed experts' int8 tensors and scales go into FusedMoE.experts_int8 as the file stores them (no
requantization), the routers stay as the checkpoint leaves them, the checkpoint selects
--quantization itself, and other schemes or partly quantized experts are refused with a message."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.configs.model_config import ModelConfig
from radixserve.distributed.communication import TensorParallelComm
from radixserve.distributed.model_parallel import ModelParallelism
from radixserve.layers.moe.int8_experts import ExpertsInt8
from radixserve.layers.moe.layer import FusedMoE
from radixserve.model_loader.errors import ModelLoadError
from radixserve.model_loader.loader import load_model
from radixserve.server_args import ServerArgs
from radixserve.testing.quantized_checkpoints import quantize_w8a8, write_quantized_checkpoint

# HF names of each projection's rows in FusedMoE's stacked weights, by checkpoint family.
_PROJ = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):
    """quantized(kind, clip=1.0) -> (W8A8 checkpoint folder, its fp32 twin folder)."""
    made: dict[tuple[str, float], tuple[Path, Path]] = {}

    def make(kind: str, clip: float = 1.0) -> tuple[Path, Path]:
        if (kind, clip) not in made:
            root = tmp_path_factory.mktemp(f"{kind}_w8a8_{clip}")
            write_quantized_checkpoint(tiny_model_dir(kind), root / "q", root / "ref", "w8a8", clip=clip)
            made[kind, clip] = (root / "q", root / "ref")
        return made[kind, clip]

    return make


def _moes(model: torch.nn.Module) -> dict[str, FusedMoE]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}


def _stored_experts(stored: dict[str, torch.Tensor], kind: str, layer: str, num: int) -> ExpertsInt8:
    """The file's expert tensors of one layer, stacked the way FusedMoE stacks them."""
    block, gate, up, down = _PROJ[kind]
    prefix = f"model.layers.{layer}.{block}.experts"

    def stack(*projs: str, suffix: str) -> torch.Tensor:
        return torch.stack(
            [torch.cat([stored[f"{prefix}.{e}.{p}.{suffix}"] for p in projs]) for e in range(num)]
        )

    return ExpertsInt8(
        stack(gate, up, suffix="weight"),
        stack(gate, up, suffix="weight_scale").squeeze(-1).float(),
        stack(down, suffix="weight"),
        stack(down, suffix="weight_scale").squeeze(-1).float(),
    )


@pytest.mark.parametrize(("kind", "clip"), [("qwen3_moe", 1.0), ("mixtral", 1.0), ("qwen3_moe", 0.9)])
def test_the_experts_load_the_files_int8_bit_for_bit(quantized, kind, clip):
    path, twin = quantized(kind, clip)
    stored = load_file(str(path / "model.safetensors"))
    model = load_model(ModelConfig.from_path(str(path)))
    moes = _moes(model)
    assert moes
    for name, moe in moes.items():
        got = moe.experts_int8
        assert got is not None and got.w13.dtype == torch.int8, name
        want = _stored_experts(stored, kind, name.split(".")[2], moe.num_experts)
        for part in ("w13", "w13_scale", "w2", "w2_scale"):
            assert torch.equal(getattr(got, part), getattr(want, part)), (name, part)
        # The fp32 experts are the exact dequantization (reads and the twin see the same model).
        w13, w2 = got.dequantize()
        assert torch.equal(moe.w13_weight, w13) and torch.equal(moe.w2_weight, w2), name
    # The routers were left out (`ignore`): the file's fp32 weights, a plain nn.Linear.
    block = model.model.layers[0].mlp
    router = f"model.layers.0.{_PROJ[kind][0]}.gate.weight"
    assert type(block.gate) is torch.nn.Linear and torch.equal(block.gate.weight, stored[router])
    if clip < 1.0:
        # A clipping observer's rows reach -128 and stop short of 127 in magnitude elsewhere:
        # requantizing the dequantized experts (what --quantization w8a8_int8 does to the fp32 twin)
        # gives other integers, so only loading the file's own keeps the checkpoint's model.
        moe = next(iter(moes.values()))
        assert bool((moe.experts_int8.w13 == -128).any())
        requantized = ExpertsInt8.quantize(moe.w13_weight, moe.w2_weight)
        assert not torch.equal(requantized.w13, moe.experts_int8.w13)


@pytest.mark.parametrize("ep_size", [1, 2])
def test_each_rank_loads_its_part_of_the_int8_experts(quantized, ep_size):
    """TP=2 (each rank a half of every expert's width) and TP=2 with EP=2 (each rank half the
    experts, whole): a rank's int8 experts are its part of the one-rank ones, scales included.
    Loading needs no collective, so both ranks are built here in one process."""
    config = ModelConfig.from_path(str(quantized("qwen3_moe")[0]))
    full = load_model(config).model.layers[1].mlp.experts.experts_int8
    inter, num_experts = full.w13.shape[1] // 2, full.w13.shape[0]
    for rank in range(2):
        parallel = ModelParallelism(tp=TensorParallelComm(rank=rank, size=2), ep_size=ep_size)
        got = load_model(config, parallel=parallel).model.layers[1].mlp.experts.experts_int8
        if ep_size == 1:
            half = torch.arange(rank * inter // 2, (rank + 1) * inter // 2)
            rows, cols = torch.cat([half, inter + half]), half  # gate rows then up rows; down's inputs
            want = ExpertsInt8(full.w13[:, rows], full.w13_scale[:, rows], full.w2[:, :, cols], full.w2_scale)
        else:
            mine = slice(rank * num_experts // 2, (rank + 1) * num_experts // 2)
            want = ExpertsInt8(full.w13[mine], full.w13_scale[mine], full.w2[mine], full.w2_scale[mine])
        for part in ("w13", "w13_scale", "w2", "w2_scale"):
            assert torch.equal(getattr(got, part), getattr(want, part)), (rank, part)


def test_the_checkpoint_selects_the_method(quantized):
    path, twin = quantized("qwen3_moe")
    assert ServerArgs(model_path=str(path), device="cpu").resolve().quantization == "compressed-tensors"
    # SGLang's compatible flag is accepted; another method is refused before anything starts.
    assert ServerArgs(
        model_path=str(path), device="cpu", quantization="w8a8_int8"
    ).resolve().quantization == ("w8a8_int8")
    with pytest.raises(ValueError, match=r"model config \(compressed-tensors\) does not match .* \(awq\)"):
        ServerArgs(model_path=str(path), device="cpu", quantization="awq").resolve()
    assert ServerArgs(model_path=str(twin), device="cpu").resolve().quantization is None


_W8A8 = {
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
    "input_activations": {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "token",
        "dynamic": True,
    },
}
_INT4_EXPERTS = {  # llm-compressor's W4A16 preset on the experts, W8A8 elsewhere ("mixed-precision")
    "format": "mixed-precision",
    "config_groups": {
        "group_0": {"targets": ["re:.*self_attn.*"], "format": "int-quantized", **_W8A8},
        "group_1": {
            "targets": ["re:.*mlp.experts.*"],
            "format": "pack-quantized",
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                "dynamic": False,
            },
        },
    },
}  # fmt: skip
_FP8 = {  # llm-compressor's FP8_DYNAMIC preset
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {
                "num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True,
            },
        }
    },
}  # fmt: skip


@pytest.mark.parametrize(
    ("scheme", "message"),
    [
        (
            _INT4_EXPERTS,
            r"config group group_1 \(targets \['re:.\*mlp.experts.\*'\]\) is W4A16 \(weights int4 symmetric "
            r"per group of 128; activations unquantized; format 'pack-quantized'\): not supported",
        ),
        (
            _FP8,
            r"config group group_0 \(targets \['Linear'\]\) is FP8 W8A8 \(weights float8 symmetric per "
            r"channel; activations float8 symmetric per token, dynamic; format 'float-quantized'\)",
        ),
    ],
)
def test_other_moe_schemes_are_refused_at_startup_naming_the_scheme(quantized, tmp_path, scheme, message):
    path = tmp_path / "other"
    shutil.copytree(quantized("qwen3_moe")[0], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "ignore": ["lm_head"], **scheme}
    (path / "config.json").write_text(json.dumps(config))
    ct = pytest.importorskip("compressed_tensors")  # the library accepts the config as it is written
    ct.QuantizationConfig.model_validate(config["quantization_config"])
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path=str(path), device="cpu").resolve()
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_path(str(path))


@pytest.mark.parametrize(
    ("unquantized", "message"),
    [
        (
            r"experts\.3\.up_proj",
            r"experts\.w13_weight: the checkpoint quantizes only some experts' .* \[3\]",
        ),
        (
            r"experts\.\d+\.down_proj",
            r"experts: the checkpoint quantizes only the experts' gate/up projections",
        ),
    ],
)
def test_partly_quantized_experts_are_refused(quantized, tiny_model_dir, tmp_path, unquantized, message):
    path = tmp_path / "partial"
    shutil.copytree(quantized("qwen3_moe")[0], path)
    fp32 = load_file(str(Path(tiny_model_dir("qwen3_moe")) / "model.safetensors"))
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight_scale") and re.search(unquantized, n)]:
        prefix = name.removesuffix("_scale")
        del tensors[name]
        tensors[prefix] = fp32[prefix]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=message):
        load_model(ModelConfig.from_path(str(path)))


def test_a_quantized_router_serves_its_exact_dequantization(quantized, tmp_path):
    """Recipes put the router in `ignore`; one that did not still loads, the router fp32 (its
    exact dequantization): routing stays a plain nn.Linear, never int8 activations."""
    path = tmp_path / "router"
    shutil.copytree(quantized("qwen3_moe")[0], path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.gate.weight"
    q, scale = quantize_w8a8(tensors[name])
    tensors[name], tensors[name.removesuffix("weight") + "weight_scale"] = q, scale
    save_file(tensors, str(path / "model.safetensors"))
    block = load_model(ModelConfig.from_path(str(path))).model.layers[1].mlp
    assert type(block.gate) is torch.nn.Linear
    assert torch.equal(block.gate.weight, q.float() * scale.float())
    assert block.experts.experts_int8 is not None
