"""Loading a GGUF MoE without its experts in fp32 (issue 37): the conversion folder leaves the routed
experts in the file, FusedMoE is built with its expert weights on the meta device, and the loader
attaches the file's quantized forms (--quantization gguf) or fills fp32 expert by expert (an fp32
model, plain-type experts), only this rank's part under --tp-size / --ep-size.

The served models decode as their dequantized HF twins: test_gguf_moe.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_quantization import _worker
from torch import nn

from radixserve.distributed.communication import TensorParallelComm
from radixserve.layers.moe.layer import FusedMoE, expert_param_name, experts_on_meta
from radixserve.model_loader import default_model
from radixserve.model_loader.gguf_experts import _open, experts_form, file_expert_weights
from radixserve.model_loader.gguf_source import conversion_dir, ensure_gguf_converted, experts_source
from radixserve.testing.tiny_gguf_moe import make_tiny_moe_gguf

pytest.importorskip("gguf")


def _tensor_names(folder: str) -> list[str]:
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def _twin_tensor(twin: str, name: str) -> torch.Tensor:
    with safe_open(os.path.join(twin, "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


def _folder_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).iterdir())


def test_conversion_leaves_the_experts_in_the_file(moe_gguf, hf_twin):
    path, folder = moe_gguf("qwen3_moe-q8_0")
    names = _tensor_names(folder)
    assert not [n for n in names if ".experts." in n]
    assert "model.layers.0.mlp.gate.weight" in names  # the router is not an expert: it stays
    twin = hf_twin("qwen3_moe-q8_0")
    assert len([n for n in _tensor_names(twin) if ".experts." in n]) > 0
    assert set(names) < set(_tensor_names(twin))
    assert _folder_bytes(folder) < _folder_bytes(twin) / 2  # the experts are most of a MoE
    assert experts_source(folder) == os.path.realpath(path)
    assert experts_source(twin) is None  # not a conversion: every weight in the folder


def _record_construction(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each FusedMoE built from now on had its expert weights on the meta device right
    after construction, and every fp32 allocation the loader asks for (False entries)."""
    seen: list[bool] = []
    init, allocate = FusedMoE.__init__, FusedMoE.allocate_fp32

    def spy_init(self: FusedMoE, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        seen.append(self.w13_weight.is_meta and self.w2_weight.is_meta)

    def spy_allocate(self: FusedMoE, device: torch.device) -> None:
        seen.append(False)
        allocate(self, device)

    monkeypatch.setattr(FusedMoE, "__init__", spy_init)
    monkeypatch.setattr(FusedMoE, "allocate_fp32", spy_allocate)
    return seen


def test_quantized_experts_never_exist_in_fp32(moe_gguf, monkeypatch):
    _, folder = moe_gguf("mixtral-q4")
    seen = _record_construction(monkeypatch)
    worker = _worker(folder, quantization="gguf")
    moes = [m for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)]
    # Built without storage and never given any: no allocate_fp32, no materialize.
    assert seen == [True] * len(moes)
    assert all(m.fp32_dropped and m.experts_wq is not None for m in moes)


def test_plain_and_fp32_experts_are_allocated_once_and_filled_from_the_file(moe_gguf, hf_twin, monkeypatch):
    for variant, flags in (("qwen3_moe-f16-experts", {"quantization": "gguf"}), ("mixtral-q4", {})):
        _, folder = moe_gguf(variant)
        seen = _record_construction(monkeypatch)
        worker = _worker(folder, **flags)
        moes = [(n, m) for n, m in worker.model_runner.model.named_modules() if isinstance(m, FusedMoE)]
        assert seen == [True] * len(moes) + [False] * len(moes)  # built on meta, then allocated once
        twin = hf_twin(variant)
        mixtral = variant.startswith("mixtral")
        proj = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for name, moe in moes:
            assert moe.experts_wq is None and not moe.fp32_dropped
            hf_name = name.replace(".mlp.", ".block_sparse_moe.") if mixtral else name
            for e in range(moe.num_experts):
                gate, up, down = (_twin_tensor(twin, f"{hf_name}.{e}.{p}.weight") for p in proj)
                assert torch.equal(moe.w13_weight[e], torch.cat([gate, up]))  # the exact dequantization
                assert torch.equal(moe.w2_weight[e], down)


class _Block(nn.Module):
    def __init__(self, moe: FusedMoE) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.experts = moe


def _one_layer(rank: int, tp_size: int, ep_size: int, config: dict) -> tuple[nn.Module, FusedMoE]:
    """A model holding layer 0's FusedMoE as rank `rank` of `tp_size` would, built as the loader
    builds it."""
    tp = TensorParallelComm(rank=rank, size=tp_size)
    with experts_on_meta():
        moe = FusedMoE(config["experts"], config["hidden"], config["inter"], tp, ep_size)
    model = nn.Module()
    model.layers = nn.ModuleList([_Block(moe)])
    return model, moe


@pytest.mark.parametrize(("tp_size", "ep_size"), [(2, 1), (2, 2), (4, 2)])
def test_each_rank_reads_its_part_of_the_file(moe_gguf, hf_twin, tp_size, ep_size):
    """fp32 experts filled from the file at every rank of TP / EP layouts equal the twin's slices,
    and the quantized forms of the same rank dequantize to them (whole quantization groups)."""
    path, _ = moe_gguf("mixtral-q4")
    twin = hf_twin("mixtral-q4")
    with open(os.path.join(twin, "config.json")) as f:
        hf = json.load(f)
    config = {
        "experts": hf["num_local_experts"],
        "hidden": hf["hidden_size"],
        "inter": hf["intermediate_size"],
    }
    for rank in range(tp_size):
        model, moe = _one_layer(rank, tp_size, ep_size, config)
        assert moe.fp32_dropped  # built without storage
        tensors = list(file_expert_weights(model, str(path), False, torch.device("cpu")))
        assert len(tensors) == 3 * moe.num_local  # this rank's experts only
        for name, tensor in tensors:
            param = moe.w2_weight if expert_param_name(name).endswith("w2_weight") else moe.w13_weight
            moe.weight_loader(param, tensor)
        width, start = moe.inter, moe.moe_tp_rank * moe.inter
        for local in range(moe.num_local):
            e = moe.expert_start + local
            prefix = f"model.layers.0.block_sparse_moe.experts.{e}"
            w1, w3, w2 = (_twin_tensor(twin, f"{prefix}.{p}.weight") for p in ("w1", "w3", "w2"))
            w13 = torch.cat([w1[start : start + width], w3[start : start + width]])
            assert torch.equal(moe.w13_weight[local], w13), (rank, e)
            assert torch.equal(moe.w2_weight[local], w2[:, start : start + width]), (rank, e)
        # The forms this rank would serve instead: the same values.
        _, reader_moe = _one_layer(rank, tp_size, ep_size, config)
        form = experts_form(str(path), _open(str(path))[0], 0, reader_moe)
        w13, w2 = form.dequantize()
        assert torch.equal(w13, moe.w13_weight) and torch.equal(w2, moe.w2_weight)


def test_resume_refills_fp32_experts_from_the_file(moe_gguf):
    _, folder = moe_gguf("qwen3_moe-q8_0")
    worker = _worker(folder)
    weights = worker.model_runner.weights
    moes = [m for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)]
    before = [(m.w13_weight.clone(), m.w2_weight.clone()) for m in moes]
    weights.release_weights()
    assert all(m.w13_weight.numel() == 0 for m in moes)
    weights.resume_weights()
    for m, (w13, w2) in zip(moes, before):
        assert torch.equal(m.w13_weight, w13) and torch.equal(m.w2_weight, w2)


def test_old_layout_conversion_is_not_reused_and_is_removed(tmp_path, monkeypatch):
    """A folder of the old converter (fp32 experts, no record of the layout) sits under another
    name: the new conversion never loads it, and deletes it once made."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(make_tiny_moe_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q8_0"))
    old = conversion_dir(path, layout=None)
    old.mkdir(parents=True)
    marker = {"conversion_version": default_model.CONVERSION_VERSION, "source_path": os.path.realpath(path)}
    (old / default_model.MARKER_FILE).write_text(json.dumps(marker))
    folder = ensure_gguf_converted(path, show_progress=False)
    assert Path(folder) != old and not old.exists()
    assert experts_source(folder) == os.path.realpath(path)


def test_an_old_layout_folder_still_serves_its_experts_as_the_file_forms(moe_gguf, hf_twin, tmp_path):
    """A folder of the old converter passed as --model-path (fp32 experts inside, a marker naming
    the file without the new layout): its experts load from the folder, are checked against the
    file's forms and dropped, as before."""
    path, _ = moe_gguf("mixtral-q4")
    old = tmp_path / "old"
    shutil.copytree(hf_twin("mixtral-q4"), old)
    marker = {
        "conversion_version": default_model.CONVERSION_VERSION,
        "source_path": os.path.realpath(path),
        "source_bytes": os.path.getsize(path),
    }
    (old / default_model.MARKER_FILE).write_text(json.dumps(marker))
    assert experts_source(str(old)) is None
    worker = _worker(str(old), quantization="gguf")
    moes = [m for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.experts_wq is not None and m.fp32_dropped for m in moes)
