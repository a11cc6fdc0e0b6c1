"""Ollama's `options` -> the OpenAI/SGLang sampling fields of the chat and completions requests.

Three kinds of options (docs/http_api.md lists them):
- honoured: mapped below (num_predict -> max_tokens, repeat_penalty -> repetition_penalty, ...);
- ignored, as Ollama ignores what does not apply: how Ollama loads and runs a model (num_ctx,
  num_gpu, num_thread, use_mmap, ...), which radixserve decides at start-up, the penalty window
  options, and names Ollama does not know either (logged);
- refused (400): a sampler radixserve does not have, set to anything but its neutral value
  (mirostat, typical_p, tfs_z), since ignoring it would change what the client asked for.
"""

from __future__ import annotations

import logging
from typing import Any

from radixserve.managers.input_validation import InvalidRequestError

logger = logging.getLogger(__name__)

# Ollama name -> OpenAI/SGLang field name, with the JSON type each must have.
_HONOURED: dict[str, tuple[str, tuple[type, ...]]] = {
    "temperature": ("temperature", (int, float)),
    "top_p": ("top_p", (int, float)),
    "top_k": ("top_k", (int,)),
    "min_p": ("min_p", (int, float)),
    "seed": ("seed", (int,)),
    "stop": ("stop", (list,)),
    "repeat_penalty": ("repetition_penalty", (int, float)),
    "presence_penalty": ("presence_penalty", (int, float)),
    "frequency_penalty": ("frequency_penalty", (int, float)),
}
_IGNORED = frozenset(
    {
        "numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
        "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
        "repeat_last_n", "penalize_newline",
    }
)  # fmt: skip
_NEUTRAL = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}  # refused unless at this value
# num_predict values that mean "no limit" (-1: until the end, -2: until the context is full).
_UNLIMITED = (-1, -2)


def sampling_fields(options: dict[str, Any] | None) -> dict[str, Any]:
    """The chat/completions request fields for `options` (max_tokens None: no limit)."""
    fields: dict[str, Any] = {"max_tokens": None}
    for name, value in (options or {}).items():
        if value is None:
            continue
        if name == "num_predict":
            fields["max_tokens"] = _num_predict(value)
        elif name in _HONOURED:
            field, types = _HONOURED[name]
            if isinstance(value, bool) or not isinstance(value, types) or not _all_str(name, value):
                raise InvalidRequestError(f"options.{name}: expected {types[0].__name__}, got {value!r}.")
            fields[field] = value
        elif name in _NEUTRAL:
            if value != _NEUTRAL[name]:
                raise InvalidRequestError(
                    f"options.{name}: this server has no such sampler (only {_NEUTRAL[name]})."
                )
        elif name not in _IGNORED:
            logger.warning("Ignoring unknown Ollama option %r", name)
    return fields


def _all_str(name: str, value: Any) -> bool:  # noqa: ANN401 - any JSON value
    return name != "stop" or all(isinstance(v, str) for v in value)


def _num_predict(value: Any) -> int | None:  # noqa: ANN401 - any JSON value
    if isinstance(value, bool) or not isinstance(value, int) or (value < 0 and value not in _UNLIMITED):
        raise InvalidRequestError(f"options.num_predict: expected a count, -1 or -2, got {value!r}.")
    return None if value in _UNLIMITED else value
