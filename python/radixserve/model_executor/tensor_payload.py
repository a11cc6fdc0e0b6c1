"""The tensors of /update_weights_from_tensor: decoding one rank's entry of `serialized_named_tensors`.

Two encodings are accepted, as base64 text (HTTP) or raw bytes (the Engine); the first bytes tell
them apart:

- **SGLang's** (what RL frameworks send): `MultiprocessingSerializer.serialize(obj, output_str=True)`,
  i.e. `obj` pickled by multiprocessing's ForkingPickler, whose torch reductions turn a tensor into
  a handle on shared memory, not its data; then base64. The server maps the sender's memory, so
  sender and server must share a host, and the sender keeps the tensors alive until the answer.
  A CPU tensor is shared the way torch.multiprocessing's sharing strategy says: `file_system` (a
  named shared-memory file, which any process of the host can open) or `file_descriptor` (the
  default: the receiver fetches the descriptor from the sender's resource sharer, which admits
  only processes holding the sender's multiprocessing authkey, i.e. its children, as the
  Engine's scheduler processes are; a separately launched server is refused).
  `obj` by `load_format`: None or "direct": a list of (name, tensor), where a tensor may be a
  LocalSerializedTensor (one serialized tensor per TP rank); "flattened_bucket":
  {"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata, ...]}.
- **radixserve's** (docs/rl.md, kept for the clients written to it): torch.save of a list of
  (name, tensor), i.e. the data itself, which also works from another host.

Unpickling runs the reductions the payload names, so only the functions and classes these
payloads need are allowed (SGLang allows whole module prefixes); SGLang's own classes are mapped
onto local equivalents, so SGLang need not be installed. The route must still be reachable only
by the trainer (docs/rl.md): a payload makes the server open shared memory and sockets it names.
"""

from __future__ import annotations

import base64
import binascii
import io
import multiprocessing
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.model_executor.weight_sync import WeightUpdateError

TENSOR_LOAD_FORMATS = (None, "direct", "flattened_bucket")
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's archive
_PICKLE_PROTO = 0x80  # pickle protocol 2+ (ForkingPickler uses the default, 4 or 5)

EXPECTED = (
    "each entry of serialized_named_tensors must be base64 of SGLang's "
    "MultiprocessingSerializer.serialize(named_tensors) (ForkingPickler with torch's "
    "multiprocessing reductions) or of radixserve's serialize_named_tensors (torch.save of "
    "[(name, tensor), ...])"
)


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    """SGLang's sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata (same fields): where
    one tensor's bytes lie in a flattened bucket."""

    name: str
    shape: Any  # torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass(frozen=True)
class LocalSerializedTensor:
    """SGLang's LocalSerializedTensor: one serialized tensor per TP rank (`values[tp_rank]`)."""

    values: list[bytes]


@dataclass(frozen=True)
class TensorPayload:
    named: list[tuple[str, torch.Tensor]]
    direct: bool  # names are the model's own (fused, sharded) parameters: copied as they are


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]], as_text: bool = True) -> str | bytes:
    """radixserve's encoding of one entry: torch.save'd (name, tensor) pairs, as base64 text
    (HTTP: safe for JSON) or raw bytes (the Engine: a third less to copy)."""
    buf = io.BytesIO()
    torch.save([(n, t.detach().cpu().contiguous()) for n, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii") if as_text else buf.getvalue()


def decode_entry(data: bytes | str, load_format: str | None, tp_rank: int) -> TensorPayload:
    """This rank's (name, tensor) pairs from its entry of `serialized_named_tensors`."""
    if load_format not in TENSOR_LOAD_FORMATS:
        raise WeightUpdateError(
            f"load_format {load_format!r} cannot update weights from tensors: use null, 'direct' or "
            "'flattened_bucket'."
        )
    raw = _raw_bytes(data)
    if raw.startswith(_ZIP_MAGIC):
        if load_format == "flattened_bucket":
            raise WeightUpdateError(
                "load_format 'flattened_bucket' takes SGLang's serializer's payload, not torch.save's."
            )
        return TensorPayload(_torch_load_pairs(raw), load_format == "direct")
    if not raw or raw[0] != _PICKLE_PROTO:
        raise WeightUpdateError(f"serialized_named_tensors cannot be decoded: {EXPECTED}.")
    obj = sglang_deserialize(raw)
    if load_format == "flattened_bucket":
        return TensorPayload(_unflatten(obj), False)
    named = _pairs(obj)
    return TensorPayload([(n, _unwrap(t, tp_rank)) for n, t in named], load_format == "direct")


def _raw_bytes(data: bytes | str) -> bytes:
    if isinstance(data, bytes):
        return data
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WeightUpdateError(f"serialized_named_tensors cannot be decoded ({exc}): {EXPECTED}.") from exc


def _torch_load_pairs(raw: bytes) -> list[tuple[str, torch.Tensor]]:
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # a malformed archive, whatever the decoder's complaint
        raise WeightUpdateError(f"serialized_named_tensors cannot be decoded: {exc}") from exc
    return _pairs(obj)


def _pairs(obj: object) -> list[tuple[str, Any]]:
    if not isinstance(obj, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in obj
    ):
        raise WeightUpdateError("serialized_named_tensors must hold a list of (name, tensor) pairs.")
    return [(str(n), t) for n, t in obj]


def _unwrap(value: object, tp_rank: int) -> Any:  # noqa: ANN401 - a tensor, or what the check refuses
    if isinstance(value, LocalSerializedTensor):
        if tp_rank >= len(value.values):
            raise WeightUpdateError(
                f"A LocalSerializedTensor has {len(value.values)} value(s); TP rank {tp_rank} needs its own."
            )
        value = sglang_deserialize(_raw_bytes(value.values[tp_rank]))
    return value


def _unflatten(obj: object) -> list[tuple[str, torch.Tensor]]:
    """SGLang's flattened bucket: every tensor's bytes back to back in one uint8 tensor."""
    if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= obj.keys():
        raise WeightUpdateError(
            "load_format 'flattened_bucket' expects {'flattened_tensor': tensor, 'metadata': [...]}."
        )
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or not all(
        isinstance(m, FlattenedTensorMetadata) for m in metadata
    ):
        raise WeightUpdateError("A flattened bucket needs a tensor and FlattenedTensorMetadata entries.")
    flat = flat.reshape(-1).view(torch.uint8)
    named = []
    for m in metadata:
        if not 0 <= m.start_idx <= m.end_idx <= flat.numel():
            raise WeightUpdateError(f"Bucket entry {m.name!r} lies outside the flattened tensor.")
        try:
            named.append((m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)))
        except RuntimeError as exc:
            raise WeightUpdateError(f"Bucket entry {m.name!r} does not fit its metadata: {exc}") from exc
    return named


# ---------------------------------------------------------------------------------- unpickling
_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED = frozenset(
    {
        (_REDUCTIONS, "rebuild_tensor"),
        (_REDUCTIONS, "rebuild_storage_fd"),
        (_REDUCTIONS, "rebuild_storage_filename"),
        (_REDUCTIONS, "rebuild_storage_empty"),
        (_REDUCTIONS, "rebuild_typed_storage"),
        (_REDUCTIONS, "rebuild_typed_storage_child"),
        (_REDUCTIONS, "rebuild_cuda_tensor"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch", "UntypedStorage"),
        ("torch", "Tensor"),
        ("torch._tensor", "Tensor"),
        ("torch.nn.parameter", "Parameter"),
        ("torch", "Size"),
        ("torch", "device"),
        ("multiprocessing.resource_sharer", "DupFd"),
    }
)


class _PayloadUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:  # noqa: ANN401 - a class or function
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        # SGLang's classes (and copies of them vendored by RL frameworks), by name.
        local = {
            "FlattenedTensorMetadata": FlattenedTensorMetadata,
            "LocalSerializedTensor": LocalSerializedTensor,
            "_rebuild_cuda_tensor_modified": _rebuild_cuda_tensor_by_uuid,
        }.get(name)
        if local is not None:
            return local
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in serialized_named_tensors (tensors, their storages "
            "and SGLang's tensor containers only)"
        )


def sglang_deserialize(raw: bytes) -> object:
    """The inverse of SGLang's MultiprocessingSerializer.serialize, restricted to tensor payloads."""
    try:
        return _PayloadUnpickler(io.BytesIO(raw)).load()
    except WeightUpdateError:
        raise
    except multiprocessing.AuthenticationError as exc:
        raise WeightUpdateError(
            "The tensors were shared by file descriptor (torch.multiprocessing's default "
            "'file_descriptor' strategy), which only a process holding the sender's "
            "multiprocessing authkey can receive. Call "
            "torch.multiprocessing.set_sharing_strategy('file_system') in the sender before "
            f"serializing ({exc})."
        ) from exc
    except (pickle.UnpicklingError, EOFError) as exc:
        raise WeightUpdateError(f"serialized_named_tensors cannot be decoded ({exc}): {EXPECTED}.") from exc
    except Exception as exc:  # a handle whose memory is gone (the sender freed it, another host)
        raise WeightUpdateError(
            f"serialized_named_tensors cannot be received ({type(exc).__name__}: {exc}); the sender "
            "must run on this host and keep the tensors alive until the answer."
        ) from exc


_CUDA_DEVICE_ARG = 6  # the device's position in torch's rebuild_cuda_tensor arguments


def _rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:  # noqa: ANN401
    """SGLang's patched reduction names the CUDA device by UUID (stable across processes whose
    CUDA_VISIBLE_DEVICES differ); map it back to this process's device index."""
    from torch.multiprocessing import reductions

    device = args[_CUDA_DEVICE_ARG]
    if isinstance(device, str):
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        if device not in uuids:
            raise WeightUpdateError(f"CUDA device {device} is not visible to this server.")
        args = (*args[:_CUDA_DEVICE_ARG], uuids.index(device), *args[_CUDA_DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)
