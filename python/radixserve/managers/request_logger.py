"""--log-requests: one log line when a request is received and one when it finishes (SGLang's
semantics, logged from the TokenizerManager where both the prompt and the output text are known).

--log-requests-level sets how much each line says:
  0: metadata (rid, token counts, finish reason, latency);
  1: metadata and sampling parameters;
  2: metadata, sampling parameters and the input / output, each cut to MAX_PARTIAL_CHARS;
  3: metadata, sampling parameters and the whole input / output.
Lines go to the "radixserve.requests" logger at INFO.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from radixserve.managers.req_state import ReqState, request_meta

logger = logging.getLogger("radixserve.requests")

# Level 2 logs at most this many characters of each text or token-id list.
MAX_PARTIAL_CHARS = 2048


class RequestLogger:
    def __init__(self, enabled: bool, level: int) -> None:
        self.enabled = enabled
        self.level = level

    def log_received(self, state: ReqState) -> None:
        if not self.enabled or state.item.no_logs:
            return
        item = state.item
        fields: dict[str, Any] = {"rid": item.rid, "prompt_tokens": len(state.input_ids)}
        if self.level >= 1:
            fields["sampling_params"] = _non_default_params(item.sampling_params)
            fields["return_logprob"] = item.return_logprob
        if self.level >= 2:
            fields["text"] = self._cut(item.text)
            fields["input_ids"] = self._cut(state.input_ids)
        logger.info("Receive: %s", _format(fields))

    def log_finished(self, state: ReqState) -> None:
        if not self.enabled or state.item.no_logs:
            return
        meta = request_meta(state)
        fields: dict[str, Any] = {
            "rid": meta.pop("id"),
            **meta,
            "e2e_latency": round(meta["e2e_latency"], 4),
        }
        if self.level >= 2:
            fields["text"] = self._cut(state.text)
            fields["output_ids"] = self._cut(state.output_ids)
        logger.info("Finish: %s", _format(fields))

    def _cut(self, value: Any) -> Any:  # noqa: ANN401 - a text or a token-id list
        """The value itself at level 3; at level 2 its repr cut to MAX_PARTIAL_CHARS characters."""
        if value is None or self.level >= 3:
            return value
        text = value if isinstance(value, str) else repr(value)
        if len(text) <= MAX_PARTIAL_CHARS:
            return value
        return f"{text[:MAX_PARTIAL_CHARS]}... ({len(text) - MAX_PARTIAL_CHARS} more characters)"


def _non_default_params(params: Any) -> dict[str, Any]:  # noqa: ANN401 - a SamplingParams
    """The sampling parameters that differ from their defaults (the whole set is long)."""
    default = type(params)()
    default.normalize()  # compare like with like: the request's params are normalized already
    return {
        f.name: getattr(params, f.name)
        for f in dataclasses.fields(params)
        if getattr(params, f.name) != getattr(default, f.name)
    }


def _format(fields: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in fields.items())
