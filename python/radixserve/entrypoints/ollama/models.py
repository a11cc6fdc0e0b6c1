"""What /api/tags, /api/show and /api/version say about the one model this server serves.

Ollama describes models it pulled into its own store; radixserve serves one model from a folder
(or a GGUF file), so: `size` is the size of the files at the model path, `digest` the SHA-256 of
that path (not of the weights: hashing gigabytes per request would be wrong), `modified_at` its
modification time, `family` the HF config's model_type, `quantization_level` --quantization or
else --dtype (empty for auto), and `version` radixserve's own version.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from typing import Any

from radixserve import __version__
from radixserve.entrypoints.ollama.protocol import ModelDetails, ModelEntry, ShowResponse
from radixserve.managers.tokenizer_manager import TokenizerManager


def _hf_config(path: str) -> dict[str, Any]:
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return {}
    with open(config, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    if not os.path.isdir(path):
        return 0
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


def _modified_at(path: str) -> str:
    mtime = os.path.getmtime(path) if os.path.exists(path) else 0.0
    return datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z")


def details(tm: TokenizerManager) -> ModelDetails:
    args = tm.server_args
    family = str(_hf_config(tm.model_path).get("model_type", ""))
    return ModelDetails(
        format="gguf" if tm.model_path.endswith(".gguf") else "safetensors",
        family=family,
        families=[family] if family else [],
        parameter_size="",  # not known without reading the weights
        # --dtype auto is decided by the scheduler (per device): not known here, so left empty.
        quantization_level=(args.quantization or (args.dtype if args.dtype != "auto" else "")).upper(),
    )


def model_entry(tm: TokenizerManager) -> ModelEntry:
    """Runs on the tokenizer threads (file system calls)."""
    return ModelEntry(
        name=tm.served_model_name,
        model=tm.served_model_name,
        modified_at=_modified_at(tm.model_path),
        size=_size(tm.model_path),
        digest=hashlib.sha256(tm.model_path.encode()).hexdigest(),
        details=details(tm),
    )


def capabilities(tm: TokenizerManager) -> list[str]:
    if not tm.is_generation:
        return ["embedding"]
    caps = ["completion", "tools"]  # tools: the chat path's tool-call parser (hermes by default)
    if tm.server_args.reasoning_parser:
        caps.append("thinking")
    return caps


def show(tm: TokenizerManager) -> ShowResponse:
    """Runs on the tokenizer threads (file system calls)."""
    info = details(tm)
    config = _hf_config(tm.model_path)
    model_info: dict[str, Any] = {"general.architecture": info.family}
    if config.get("architectures"):
        model_info["general.architectures"] = config["architectures"]
    model_info[f"{info.family or 'general'}.context_length"] = tm.context_len
    return ShowResponse(
        modelfile=f"FROM {tm.model_path}\n",
        parameters="",
        template=_template(tm),
        details=info,
        model_info=model_info,
        capabilities=capabilities(tm),
        modified_at=_modified_at(tm.model_path),
    )


def _template(tm: TokenizerManager) -> str:
    template = getattr(tm.tokenizer, "chat_template", None)
    return template if isinstance(template, str) else ""


def version() -> str:
    return __version__
