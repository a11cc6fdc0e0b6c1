"""LoRA pieces on their own: the batched delta (segmented vs the torch-native reference), adapter
checks, the slot pool's LRU, the admission gate, and the flags."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from radixserve.lora.adapter import (
    BaseShapes,
    LoRAError,
    load_adapter,
    lora_updates,
    normalize_target_modules,
    parse_lora_paths,
)
from radixserve.lora.batch_gate import LoRABatchGate
from radixserve.lora.kernels import (
    LoRASegments,
    lora_delta_dense,
    lora_delta_reference,
    lora_delta_segmented,
)
from radixserve.lora.pool import LoRASlots
from radixserve.server_args import ServerArgs, prepare_server_args


@pytest.mark.parametrize(
    "slots",
    [
        [-1, -1, -1],
        [0, 0, 0, 0],
        [2, -1, 0, 2, 1, -1, 0, 0],  # interleaved: gathered groups
        [1, 1, 1, -1, -1, 3, 3],  # sorted runs with base rows between: gathered
        [-1, 0, 0, 2, 2, 2],  # in slot order: a slice
    ],
)
def test_segmented_delta_matches_reference(slots):
    gen = torch.Generator().manual_seed(0)
    n, d_in, d_out, rank, num_slots = len(slots), 24, 40, 8, 4
    x = torch.randn(n, d_in, generator=gen)
    a = torch.randn(num_slots, rank, d_in, generator=gen)
    b = torch.randn(num_slots, rank, d_out, generator=gen)
    token_slots = torch.tensor(slots, dtype=torch.int64)
    base = torch.randn(n, d_out + 8, generator=gen)
    want, got, dense = base.clone(), base.clone(), base.clone()
    # A column slice of a wider output, as the fused qkv / gate_up outputs are written.
    lora_delta_reference(x, a, b, token_slots, want[:, 4 : 4 + d_out])
    segments = LoRASegments.build(token_slots)
    assert (segments is None) == all(s < 0 for s in slots)
    if segments is not None:
        lora_delta_segmented(x, a, b, segments, got[:, 4 : 4 + d_out])
        lora_delta_dense(x, a, b, segments, dense[:, 4 : 4 + d_out])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(dense, want)
    explicit = base.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            explicit[t, 4 : 4 + d_out] += (a[s] @ x[t]) @ b[s]
    torch.testing.assert_close(got, explicit, rtol=1e-4, atol=1e-4)
    base_rows = torch.tensor(slots) < 0
    assert torch.equal(got[base_rows], base[base_rows]) and torch.equal(dense[base_rows], base[base_rows])


def test_segments_sort_rows_by_slot():
    seg = LoRASegments.build(torch.tensor([1, 1, -1, 0, 1]))
    assert seg.rows.tolist() == [3, 0, 1, 4] and seg.segments == ((0, 0, 1), (1, 1, 4))
    prefill = LoRASegments.build(torch.tensor([-1, 2, 2, 2, 5, 5]))  # already in slot order
    assert prefill.rows == slice(1, 6) and prefill.segments == ((2, 0, 3), (5, 3, 5))


BASE = BaseShapes(2, {"q_proj": (8, 8), "k_proj": (8, 4), "v_proj": (8, 4), "o_proj": (8, 8),
                      "gate_proj": (8, 16), "up_proj": (8, 16), "down_proj": (16, 8)})  # fmt: skip
ALL = normalize_target_modules("all")


def _write_adapter(path, rank=4, modules=("q_proj", "v_proj"), shapes=None, layers=2, alpha=8):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(
        json.dumps({"r": rank, "lora_alpha": alpha, "target_modules": list(modules), "peft_type": "LORA"})
    )
    tensors = {}
    for layer in range(layers):
        for m in modules:
            d_in, d_out = (shapes or BASE.shapes).get(m, (8, 8))
            parent = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.ones(rank, d_in)
            tensors[f"{key}.lora_B.weight"] = torch.ones(d_out, rank)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def test_adapter_loads_with_scaling_folded_into_b(tmp_path):
    adapter = load_adapter("x", _write_adapter(tmp_path / "x"), BASE, 8, ALL)
    assert adapter.rank == 4 and adapter.scaling == 2.0
    assert adapter.target_modules == ("q_proj", "v_proj")
    a, b = adapter.weights[(1, "v_proj")]  # as PEFT stores them: [r, in], [out, r]
    assert a.shape == (4, 8) and b.shape == (4, 4) and float(b[0, 0]) == 2.0


@pytest.mark.parametrize(
    "kwargs, enabled, message",
    [
        ({"rank": 16}, ALL, "above --max-lora-rank 8"),
        ({}, ("q_proj",), "was not started for"),
        ({"shapes": {**BASE.shapes, "q_proj": (8, 12)}}, ALL, "does not fit this base model"),
        ({"layers": 3}, ALL, "layer 2, the base model has 2"),
    ],
)
def test_adapter_refusals(tmp_path, kwargs, enabled, message):
    with pytest.raises(LoRAError, match=message):
        load_adapter("x", _write_adapter(tmp_path / "x", **kwargs), BASE, 8, enabled)


def test_corrupt_missing_and_unknown_module(tmp_path):
    path = _write_adapter(tmp_path / "x")
    (tmp_path / "x" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoRAError, match="corrupt"):
        load_adapter("x", path, BASE, 8, ALL)
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        load_adapter("y", str(tmp_path / "nowhere"), BASE, 8, ALL)
    with pytest.raises(LoRAError, match="not supported"):
        load_adapter("z", _write_adapter(tmp_path / "z", modules=("lm_head",)), BASE, 8, ALL)


def test_slots_evict_least_recently_used_never_the_batch():
    slots = LoRASlots(2)
    assert slots.assign({"a"})[1] == [(0, "a")]
    assert slots.assign({"b"})[1] == [(1, "b")]
    assert slots.assign({"a"})[1] == []  # resident: nothing copied
    slot_of, loads = slots.assign({"a", "c"})  # b is the least recently used and not wanted
    assert loads == [(1, "c")] and slot_of == {"a": 0, "c": 1}
    with pytest.raises(RuntimeError, match="max-loras-per-batch"):
        slots.assign({"a", "b", "c"})


@dataclass
class _R:
    lora_id: str | None


def test_gate_caps_distinct_adapters_base_is_free():
    gate = LoRABatchGate(2)
    present = gate.adapters_of([_R("a"), _R(None), _R("a")])
    assert present == {"a"}
    assert gate.admits(_R("b"), present)
    present.add("b")
    assert not gate.admits(_R("c"), present)  # a third adapter waits
    assert gate.admits(_R("a"), present) and gate.admits(_R(None), present)


def test_lora_flags_parse_and_resolve(tmp_path):
    path = _write_adapter(tmp_path / "ad", rank=6, modules=("q_proj", "down_proj"))
    args = prepare_server_args(["--lora-paths", f"one={path}", path, "--max-loras-per-batch", "4"])
    assert args.lora_paths == [f"one={path}", path] and args.max_loras_per_batch == 4
    assert parse_lora_paths(args.lora_paths) == {"one": path, path: path}
    resolved = lora_updates(ServerArgs(lora_paths=(f"one={path}",)))
    assert resolved["enable_lora"] and resolved["max_lora_rank"] == 6
    assert resolved["lora_target_modules"] == ("q_proj", "down_proj")
    with pytest.raises(ValueError, match="twice"):
        parse_lora_paths(["a=x", "a=y"])
    with pytest.raises(ValueError, match="drop --is-embedding"):
        ServerArgs(enable_lora=True, is_embedding=True, device="cpu").validate()
    # Adapters are sharded (TP), split by layer (PP), loaded on every replica (DP) and on both
    # sides of a disaggregated pair.
    for layout in ({"tp_size": 2}, {"pp_size": 2}, {"dp_size": 2}, {"disaggregation_mode": "prefill"}):
        ServerArgs(enable_lora=True, device="cpu", **layout).validate()
