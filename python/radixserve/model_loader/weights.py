"""Find and stream the tensors of an HF-format safetensors checkpoint (single file or sharded)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from radixserve.model_loader.errors import ModelLoadError

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Formats we recognise only to explain that they are not loadable.
_OTHER_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.gguf", "*.msgpack", "*.h5")


def find_weight_files(path: str) -> list[str]:
    """The safetensors files to load, validated to exist; the index decides when there is one."""
    if not os.path.isdir(path):
        raise ModelLoadError(f"Model path {path} does not exist or is not a folder.")
    index_path = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        return sorted(_read_index(index_path))
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise _no_weights_error(path)
    return files


def _read_index(index_path: str) -> dict[str, set[str]]:
    """shard file -> tensor names it must contain, per model.safetensors.index.json."""
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"Corrupt {index_path}: expected JSON with a 'weight_map' ({exc}).") from exc
    folder = os.path.dirname(index_path)
    shards: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(os.path.join(folder, shard), set()).add(name)
    missing = [os.path.basename(s) for s in shards if not os.path.isfile(s)]
    if missing:
        raise ModelLoadError(
            f"{index_path} references weight shard(s) missing from {folder}: {', '.join(sorted(missing))}. "
            "The download or copy is incomplete."
        )
    if not shards:
        raise ModelLoadError(f"{index_path} has an empty weight_map.")
    return shards


def _no_weights_error(path: str) -> ModelLoadError:
    others = sorted(
        os.path.basename(f) for pat in _OTHER_WEIGHT_PATTERNS for f in glob.glob(os.path.join(path, pat))
    )
    hint = (
        f" Found {', '.join(others[:5])}: only safetensors is supported; convert with "
        "transformers (`model.save_pretrained(dir, safe_serialization=True)`)."
        if others
        else ""
    )
    return ModelLoadError(f"No *.safetensors weight files in {path}.{hint}")


class CheckpointTensor:
    """One checkpoint tensor, read on demand: whole, or one slice along a dimension, in which case
    only that slice's bytes are read (a tensor-parallel rank reads its shard, never the whole)."""

    def __init__(
        self, name: str, shape: tuple[int, ...], read: Callable[[int, int, int], torch.Tensor]
    ) -> None:
        self.name = name
        self.shape = shape
        self._read = read  # (dim, start, length) -> tensor

    @classmethod
    def of(cls, name: str, value: torch.Tensor | CheckpointTensor) -> CheckpointTensor:
        """Wrap an in-memory tensor (tests, converted weights); pass a CheckpointTensor through."""
        if isinstance(value, CheckpointTensor):
            return value
        return cls(name, tuple(value.shape), lambda dim, start, length: value.narrow(dim, start, length))

    def full(self) -> torch.Tensor:
        if not self.shape:
            return self._read(-1, 0, 0)
        return self._read(0, 0, self.shape[0])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ModelLoadError(
                f"Tensor {self.name!r} of shape {self.shape} has no rows [{start}, {start + length}) "
                f"along dim {dim}: the checkpoint does not match the config"
            )
        return self._read(dim, start, length)


def iterate_weights(path: str, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor in the checkpoint at `path`, one shard at a time.

    File discovery and the index check run now, so a missing shard is reported before the model
    is built; header/data problems surface when the shard is reached.
    """
    return ((name, t.full()) for name, t in iterate_checkpoint(path, show_progress))


def iterate_checkpoint(path: str, show_progress: bool = True) -> Iterator[tuple[str, CheckpointTensor]]:
    """Like iterate_weights, but yields CheckpointTensors so callers read only what they need."""
    index_path = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        expected = _read_index(index_path)
        return _iterate_files(sorted(expected), expected, show_progress)
    return _iterate_files(find_weight_files(path), {}, show_progress)


def _iterate_files(
    files: list[str], expected: dict[str, set[str]], show_progress: bool
) -> Iterator[tuple[str, CheckpointTensor]]:
    # The bar is per shard: a tensor-level bar would redraw thousands of times for big models.
    bar = tqdm(files, desc="Loading safetensors shards", unit="shard", disable=not show_progress)
    for file in bar:
        yield from _iterate_file(file, expected.get(file))


def _iterate_file(file: str, expected_names: set[str] | None) -> Iterator[tuple[str, CheckpointTensor]]:
    handle = _open(file)
    names = list(handle.keys())
    if expected_names is not None and not expected_names.issubset(names):
        missing = sorted(expected_names.difference(names))
        raise ModelLoadError(
            f"Weight shard {file} lacks {len(missing)} tensor(s) the index assigns to it, "
            f"e.g. {', '.join(missing[:3])}. The shard is from another checkpoint or is damaged."
        )
    for name in names:
        try:
            sliced = handle.get_slice(name)
            shape = tuple(int(d) for d in sliced.get_shape())
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"Cannot read tensor '{name}' from {file}: {exc}") from exc
        yield name, CheckpointTensor(name, shape, _slice_reader(file, name, sliced))


def _slice_reader(file: str, name: str, sliced: Any) -> Callable[[int, int, int], torch.Tensor]:  # noqa: ANN401
    def read(dim: int, start: int, length: int) -> torch.Tensor:
        try:
            if dim < 0:  # a 0-d tensor
                return sliced[...]
            index = (slice(None),) * dim + (slice(start, start + length),)
            return sliced[index]
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"Cannot read tensor '{name}' from {file}: {exc}") from exc

    return read


def _open(file: str) -> Any:
    if not os.access(file, os.R_OK):
        raise ModelLoadError(f"Weight file {file} is not readable (check its permissions).")
    try:
        return safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(
            f"Weight file {file} is not a valid safetensors file ({exc}). It may be truncated or corrupt; "
            "re-download or re-save it."
        ) from exc
