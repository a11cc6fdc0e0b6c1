"""Content keys of L3 pages: a chain of sha256 hashes over the token prefix.

A page's key is hash(previous page's key, this page's tokens); the first page's "previous key" is
the seed of its namespace, hash(model identity, cache namespace). So a key names the whole prefix
up to the end of its page, and two servers agree on it only if they run the same model (config,
weights, dtype, KV layout, page size, TP shard) in the same namespace (LoRA adapter, cache_salt).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelIdentity:
    """What makes one server's KV pages usable by another."""

    config_digest: str  # sha256 of the model's config.json ("" if it has none)
    weights_digest: str  # sha256 of the weight files' names and sizes
    weight_version: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    tp_rank: int
    tp_size: int

    def seed(self, namespace: Hashable) -> str:
        text = json.dumps([self.__dict__, repr(namespace)], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


def model_files_digests(model_path: str | None) -> tuple[str, str]:
    """(config digest, weights digest) of a model folder. Weight files are fingerprinted by name
    and size, not content: hashing gigabytes at every start would cost more than it protects
    (a changed checkpoint under the same names and sizes should change --weight-version)."""
    if not model_path or not os.path.isdir(model_path):
        return "", ""
    config = os.path.join(model_path, "config.json")
    cfg = ""
    if os.path.isfile(config):
        with open(config, "rb") as f:
            cfg = hashlib.sha256(f.read()).hexdigest()
    weights = sorted(
        (e.name, e.stat().st_size)
        for e in os.scandir(model_path)
        if e.is_file() and e.name.endswith((".safetensors", ".bin", ".pt", ".gguf"))
    )
    return cfg, hashlib.sha256(repr(weights).encode()).hexdigest()


def chain_keys(prev: str, tokens: Sequence[int], page_size: int) -> list[str]:
    """Keys of the whole pages of ``tokens`` ([n] ids, n a page multiple), continuing from the
    key ``prev`` (the previous page's, or the namespace seed)."""
    keys = []
    data = torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes()
    step = 8 * page_size
    for i in range(0, len(data), step):
        prev = hashlib.sha256(prev.encode() + data[i : i + step]).hexdigest()
        keys.append(prev)
    return keys
