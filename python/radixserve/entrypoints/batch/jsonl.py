"""Validation of a batch input file (JSONL, one request a line), done once at upload so that a
batch never starts on a file it cannot run. Every refusal names its line (1-based, as editors
count) and is a 400."""

from __future__ import annotations

import json

from pydantic import ValidationError

from radixserve.entrypoints.batch.protocol import BATCH_ENDPOINTS, BatchLine
from radixserve.managers.input_validation import InvalidRequestError

MAX_LINES = 50_000  # OpenAI's limit per batch file


def supported_endpoints(is_generation: bool) -> tuple[str, ...]:
    """A generation model answers chat and completions; an embedding model, embeddings."""
    if is_generation:
        return tuple(u for u in BATCH_ENDPOINTS if u != "/v1/embeddings")
    return ("/v1/embeddings",)


def parse_batch_file(content: bytes, is_generation: bool) -> list[BatchLine]:
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"The file is not UTF-8 text (byte {exc.start}).") from exc
    rows = [(n, raw) for n, raw in enumerate(text.splitlines(), start=1) if raw.strip()]
    if not rows:
        raise InvalidRequestError("The file holds no requests: a batch file has one JSON object a line.")
    if len(rows) > MAX_LINES:
        raise InvalidRequestError(f"The file holds {len(rows)} requests; a batch takes at most {MAX_LINES}.")
    endpoints = supported_endpoints(is_generation)
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    for n, raw in rows:
        line = _parse_line(n, raw)
        if line.url not in endpoints:
            raise InvalidRequestError(
                f"Line {n}: url {line.url!r} is not supported by this server's model; "
                f"use one of {', '.join(endpoints)}."
            )
        if line.body.get("stream"):
            raise InvalidRequestError(f"Line {n}: body.stream: a batch request cannot stream.")
        if line.custom_id in seen:
            raise InvalidRequestError(
                f"Line {n}: custom_id {line.custom_id!r} is already used on line {seen[line.custom_id]}; "
                "each request needs a unique custom_id."
            )
        seen[line.custom_id] = n
        lines.append(line)
    return lines


def _parse_line(n: int, raw: str) -> BatchLine:
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequestError(f"Line {n}: not valid JSON ({exc}).") from exc
    if not isinstance(value, dict):
        raise InvalidRequestError(f"Line {n}: a batch line must be a JSON object.")
    try:
        return BatchLine.model_validate(value, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "line"
        raise InvalidRequestError(f"Line {n}: {field}: {first['msg']}.") from exc
