"""Constrained decoding on the built-in SmolLM2-135M-Instruct (a real tokenizer and vocab)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

pytest.importorskip("xgrammar")

from radixserve.testing.inprocess import InProcessScheduler  # noqa: E402
from radixserve.testing.json_schemas import random_schemas  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "music", "hiking"]}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def builtin() -> Iterator[InProcessScheduler]:
    from radixserve.model_loader.default_model import ensure_default_model

    try:
        path = ensure_default_model(show_progress=False)
    except Exception as exc:  # the wheel is installed by `make setup`
        pytest.skip(f"built-in model unavailable: {exc}")
    sched = InProcessScheduler(path, max_total_tokens=8192, max_running_requests=16)
    yield sched
    sched.close()


def chat(sched: InProcessScheduler, text: str) -> list[int]:
    prompt = sched.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return sched.tokenizer.encode(prompt, add_special_tokens=False)


def test_builtin_schemas_regex_and_json_object(builtin: InProcessScheduler) -> None:
    schemas = [PERSON, *random_schemas(seed=5, count=2)]
    ask = chat(builtin, "Describe a person as JSON.")
    for i, schema in enumerate(schemas):
        for t in (0.0, 0.8):
            builtin.submit(
                f"s{i}-{t}", ask, max_new_tokens=160, temperature=t, seed=i, json_schema=json.dumps(schema)
            )
    short = chat(builtin, 'Reply with the JSON object {"a": 1}.')
    builtin.submit("obj", short, max_new_tokens=48, json_schema='{"type": "object"}')
    builtin.submit(
        "date",
        chat(builtin, "When did WW2 end? Answer with a date."),
        max_new_tokens=20,
        regex=r"\d{4}-\d{2}-\d{2}",
    )
    builtin.submit("yn", chat(builtin, "Is Paris in France?"), max_new_tokens=5, regex=r"(yes|no)")
    results = builtin.run_until_idle()
    for i, schema in enumerate(schemas):
        for t in (0.0, 0.8):
            res = results[f"s{i}-{t}"]
            assert res.finish_reason["type"] == "stop", (res.finish_reason, res.text)
            jsonschema.validate(json.loads(res.text), schema)
    obj = results["obj"]
    assert obj.finish_reason["type"] == "stop", obj.text
    assert isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", results["date"].text)
    assert results["yn"].text == "yes"
