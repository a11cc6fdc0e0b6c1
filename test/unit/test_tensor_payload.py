"""Decoding /update_weights_from_tensor's entries: SGLang's MultiprocessingSerializer format
(ForkingPickler with torch's reductions, base64; plain pairs, LocalSerializedTensor and the
flattened bucket, under SGLang's own class names), radixserve's torch.save format, and refusals
(other pickles, other bytes, unknown load formats) with a message that says what is expected.

SGLang's serializer is re-implemented here in its few lines (sglang is not a dependency)."""

from __future__ import annotations

import base64
import io
import os
import pickle
import sys
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # registers torch's reductions with ForkingPickler

from radixserve.model_executor.tensor_payload import decode_entry, serialize_named_tensors
from radixserve.model_executor.weight_sync import WeightUpdateError


def sglang_serialize(obj: object, output_str: bool = True) -> str | bytes:
    """What SGLang's MultiprocessingSerializer.serialize(obj, output_str) produces."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8") if output_str else buf.getvalue()


@pytest.fixture(params=["file_descriptor", "file_system"])
def strategy(request: pytest.FixtureRequest):
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(request.param)
    yield request.param
    torch.multiprocessing.set_sharing_strategy(before)


@pytest.fixture
def sglang_classes(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Stand-ins for SGLang's classes, under SGLang's module names, so that pickles name them as
    SGLang's serializer would."""
    bucket_mod, runner_mod = "sglang.srt.weight_sync.tensor_bucket", "sglang.srt.model_executor.model_runner"
    for name in ("sglang", "sglang.srt", "sglang.srt.weight_sync", "sglang.srt.model_executor"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))

    @dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    @dataclass
    class LocalSerializedTensor:
        values: list[bytes]

    classes = types.SimpleNamespace(meta=FlattenedTensorMetadata, local=LocalSerializedTensor)
    for cls, mod in ((FlattenedTensorMetadata, bucket_mod), (LocalSerializedTensor, runner_mod)):
        module = types.ModuleType(mod)
        cls.__module__, cls.__qualname__ = mod, cls.__name__
        setattr(module, cls.__name__, cls)
        monkeypatch.setitem(sys.modules, mod, module)
    return classes


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 4, generator=g)),
        ("model.norm.weight", torch.randn(4, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.nn.Parameter(torch.randn(6, 4, generator=g))),
        ("model.embed_tokens.weight", torch.randn(12, 4, generator=g)[2:8]),  # a view into a bigger storage
    ]


def _same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b.detach())


def test_sglang_pairs_in_both_sharing_strategies(strategy: str) -> None:
    named = _named()
    for data in (sglang_serialize(named), sglang_serialize(named, output_str=False)):
        payload = decode_entry(data, None, 0)
        _same(payload.named, named)
        assert not payload.direct
    assert decode_entry(sglang_serialize(named), "direct", 0).direct


def test_sglang_local_serialized_tensor_takes_the_ranks_own_value(sglang_classes, strategy: str) -> None:
    per_rank = [torch.full((2, 3), float(r)) for r in range(2)]
    local = sglang_classes.local(values=[sglang_serialize(t, output_str=False) for t in per_rank])
    data = sglang_serialize([("model.norm.weight", local)])
    for rank in (0, 1):
        ((name, tensor),) = decode_entry(data, None, rank).named
        assert name == "model.norm.weight" and torch.equal(tensor, per_rank[rank])
    with pytest.raises(WeightUpdateError, match="TP rank 2 needs its own"):
        decode_entry(sglang_serialize([("model.norm.weight", local)]), None, 2)


def test_sglang_flattened_bucket(sglang_classes, strategy: str) -> None:
    named = _named()
    flats, metadata, at = [], [], 0
    for name, t in named:  # SGLang's FlattenedTensorBucket: every tensor's bytes back to back
        flat = t.detach().contiguous().flatten().view(torch.uint8)
        metadata.append(sglang_classes.meta(name, t.shape, t.dtype, at, at + flat.numel(), flat.numel()))
        flats.append(flat)
        at += flat.numel()
    bucket = {"flattened_tensor": torch.cat(flats), "metadata": metadata}
    _same(decode_entry(sglang_serialize(bucket), "flattened_bucket", 0).named, named)

    metadata[1] = sglang_classes.meta("model.norm.weight", torch.Size([4]), torch.bfloat16, at - 2, at + 6, 8)
    with pytest.raises(WeightUpdateError, match="outside the flattened tensor"):
        decode_entry(sglang_serialize(bucket), "flattened_bucket", 0)
    with pytest.raises(WeightUpdateError, match="expects"):
        decode_entry(sglang_serialize(_named()), "flattened_bucket", 0)


def test_radixserve_torch_save_format_is_still_accepted() -> None:
    named = _named()
    for data in (serialize_named_tensors(named), serialize_named_tensors(named, as_text=False)):
        _same(decode_entry(data, None, 0).named, named)
    with pytest.raises(WeightUpdateError, match="flattened_bucket"):
        decode_entry(serialize_named_tensors(named), "flattened_bucket", 0)


class _Evil:
    def __reduce__(self) -> tuple:
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize(
    ("data", "load_format", "needle"),
    [
        (base64.b64encode(pickle.dumps([("x", _Evil())])).decode(), None, "posix.system is not allowed"),
        (base64.b64encode(pickle.dumps({"a": print})).decode(), None, "builtins.print is not allowed"),
        ("not base64!", None, "MultiprocessingSerializer.serialize"),
        (base64.b64encode(b"plain bytes").decode(), None, "MultiprocessingSerializer.serialize"),
        (base64.b64encode(b"\x80\x04truncated").decode(), None, "cannot be decoded"),
        (base64.b64encode(pickle.dumps([1, 2])).decode(), None, "list of (name, tensor) pairs"),
        (serialize_named_tensors([]), "gguf", "use null, 'direct' or 'flattened_bucket'"),
    ],
    ids=["os.system", "builtin", "not-base64", "other-bytes", "truncated", "not-pairs", "load-format"],
)
def test_anything_else_is_refused_with_what_is_expected(
    data: str, load_format: str | None, needle: str
) -> None:
    with pytest.raises(WeightUpdateError) as info:
        decode_entry(data, load_format, 0)
    assert needle in str(info.value)
