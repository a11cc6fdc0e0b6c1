"""Seeded random JSON schemas for structured-output tests and benchmarks.

Every schema is bounded (string maxLength, array maxItems, integer and number ranges, enums,
additionalProperties false) so that even a random model, which the grammar alone steers, finishes
the document in a bounded number of tokens.
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "x", "y", "zeta"]
_MAX_DEPTH = 2


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema with 1-4 properties, nested objects/arrays up to depth 2."""
    names = rng.sample(
        ["id", "name", "count", "score", "tags", "ok", "kind", "info", "items", "pos"], k=rng.randint(1, 4)
    )
    props = {name: _random_value(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _random_value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "string", "boolean", "enum", "null"]
    if depth < _MAX_DEPTH:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        low = rng.choice([-10.5, -1, 0, 0.25, 3])
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([1, 10, 100.5])}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        values: list[Any] = rng.sample(_WORDS, k=rng.randint(1, 4))
        if rng.random() < 0.3:
            values.append(rng.randint(0, 9))
        return {"enum": values}
    if kind == "object":
        return random_schema(rng, depth + 1)
    items = _random_value(rng, _MAX_DEPTH) if rng.random() < 0.6 else random_schema(rng, depth + 1)
    return {"type": "array", "items": items, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}


def random_schemas(seed: int, count: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]
