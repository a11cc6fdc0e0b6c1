"""AutoConfig's answer for a model's config.json, kept on disk so that the next process that reads the
same file gets the same values without importing transformers' config classes.

Why: importing any of transformers' model config classes imports its weight-loading stack
(torch.distributed.tensor, sympy): ~1.3-2.8 CPU s in every scheduler rank of every start, which
the engine does not otherwise need. The first process to read a config.json builds it with
AutoConfig as before and writes what that object answers (its attribute values, aliases and the
names it has) under $RADIXSERVE_CACHE_DIR/hf_config/; later processes read that file instead.

The values are AutoConfig's own, so nothing is re-derived here (no defaults, aliases or rope
normalization per architecture). What does not survive a JSON round trip exactly (tuples, sets,
dicts with int keys, objects) is not stored: reading such an attribute loads AutoConfig then, so
a `CachedHFConfig` answers every attribute as AutoConfig does. The key is the file's bytes and
transformers' version, so an edited config.json or another transformers is read afresh.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from radixserve.configs.architectures import TEXT_DECODER_ARCHITECTURES
from radixserve.model_loader.default_model import cache_root

logger = logging.getLogger(__name__)

# Architectures whose config radixserve reads as flat attributes: their cached answer is complete.
# Vision-language models (a text sub-config object) and encoders (int-keyed label maps) always
# use AutoConfig.
CACHED_ARCHITECTURES: frozenset[str] = frozenset(TEXT_DECODER_ARCHITECTURES)
# Deprecated spellings that log a warning when read; radixserve reads their new names.
_SKIPPED = frozenset({"torch_dtype", "use_return_dict"})
_FORMAT = 1  # bump when the file's layout changes


def cache_dir() -> Path:
    return cache_root() / "hf_config"


class CachedHFConfig:
    """Read-only stand-in for a text model's PretrainedConfig, answering from the cached values."""

    def __init__(self, path: str, snapshot: dict[str, Any]) -> None:
        self._path = path
        self._name_or_path = path
        self._values: dict[str, Any] = dict(snapshot["values"])
        for name, dtype_name in snapshot["dtypes"].items():
            self._values[name] = getattr(torch, dtype_name)
        self._values["name_or_path"] = path
        self._aliases: dict[str, str] = snapshot["aliases"]
        self._names: frozenset[str] = frozenset(snapshot["names"])
        self._real: Any = None

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401
        # Private names (pickle's __setstate__ probe included) never reach the cached values.
        if name.startswith("_"):
            raise AttributeError(name)
        values = self.__dict__["_values"]
        if name in values:
            return values[name]
        alias = self.__dict__["_aliases"].get(name)
        if alias in values:
            return values[alias]
        if name not in self.__dict__["_names"] and name not in self.__dict__["_aliases"]:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(self.full(), name)

    def full(self) -> Any:  # noqa: ANN401
        """The AutoConfig object itself, loaded on first need (an attribute the cache lacks)."""
        if self._real is None:
            logger.debug("Loading AutoConfig for %s (attribute not cached)", self._path)
            self._real = autoconfig(self._path)
        return self._real

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> CachedHFConfig:
        # A text-only model's config is its own text config (PretrainedConfig.get_text_config).
        return self

    def __repr__(self) -> str:
        return f"CachedHFConfig({self._path!r}, model_type={self._values.get('model_type')!r})"


def autoconfig(path: str) -> Any:  # noqa: ANN401
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def _key(config_bytes: bytes) -> str:
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        version = "none"
    digest = hashlib.sha256(config_bytes)
    digest.update(f"\0transformers={version}\0format={_FORMAT}".encode())
    return digest.hexdigest()[:32]


def _config_bytes(path: str) -> bytes | None:
    try:
        with open(os.path.join(path, "config.json"), "rb") as f:
            return f.read()
    except OSError:
        return None


def _architecture(config_bytes: bytes) -> str | None:
    try:
        config = json.loads(config_bytes)
    except ValueError:
        return None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return architectures[0] if isinstance(architectures, list) and architectures else None


def read_cached(path: str) -> CachedHFConfig | None:
    """The cached answer for `path`'s config.json, or None (not cached, not cacheable, unreadable)."""
    config_bytes = _config_bytes(path)
    if config_bytes is None or _architecture(config_bytes) not in CACHED_ARCHITECTURES:
        return None
    try:
        with open(cache_dir() / f"{_key(config_bytes)}.json", encoding="utf-8") as f:
            return CachedHFConfig(path, json.load(f))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _round_trips(value: Any) -> bool:  # noqa: ANN401
    try:
        back = json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return False
    return type(back) is type(value) and back == value and json.dumps(back) == json.dumps(value)


def snapshot(config: Any) -> dict[str, Any]:  # noqa: ANN401
    """What `config` answers: every public non-method attribute that JSON keeps exactly, torch
    dtypes by name, its attribute_map, and the names it has (so an absent one stays absent)."""
    values: dict[str, Any] = {}
    dtypes: dict[str, str] = {}
    names = sorted(n for n in dir(config) if not n.startswith("_"))
    for name in names:
        if name in _SKIPPED:
            continue
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001 - a property that fails is left to AutoConfig, as unstored
            continue
        if callable(value):
            continue
        if isinstance(value, torch.dtype):
            dtypes[name] = str(value).removeprefix("torch.")
        elif name != "name_or_path" and _round_trips(value):
            values[name] = value
    aliases = dict(getattr(config, "attribute_map", None) or {})
    return {"values": values, "dtypes": dtypes, "aliases": aliases, "names": names}


def remember(path: str, config: Any) -> None:  # noqa: ANN401
    """Write `config`'s snapshot for `path`'s config.json; a failure only costs the next start."""
    config_bytes = _config_bytes(path)
    if config_bytes is None or _architecture(config_bytes) not in CACHED_ARCHITECTURES:
        return
    target = cache_dir() / f"{_key(config_bytes)}.json"
    if target.exists():
        return
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".json")
    except OSError as exc:
        logger.debug("Not caching %s's config: %s", path, exc)
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(snapshot(config), f)
        os.replace(tmp, target)  # atomic: a concurrent reader sees the whole file or none
    except OSError as exc:
        logger.debug("Not caching %s's config: %s", path, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
