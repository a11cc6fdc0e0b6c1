"""Constrained decoding on a MoE model (tiny random Qwen3-MoE): the grammar masks the logits the
MoE layers produce like any other model's, so regex, EBNF and JSON-schema outputs match in full,
greedy and sampled, and the scheduler leaks nothing."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from radixserve.testing.inprocess import InProcessScheduler  # noqa: E402
from radixserve.testing.json_schemas import random_schemas  # noqa: E402

REGEX = r"\d{4}-\d{2}-\d{2}"
EBNF = 'root ::= "answer: " choice\nchoice ::= "yes" | "no" | [0-9] [0-9]?\n'
EBNF_RE = r"answer: (yes|no|[0-9]{1,2})"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_grammars_hold_on_a_moe_model(temperature, tiny_model_dir):
    sched = InProcessScheduler(tiny_model_dir("qwen3_moe"), max_total_tokens=4096, chunked_prefill_size=32)
    schemas = random_schemas(seed=77, count=4)
    for j, prompt in enumerate(["Date:", "Is it?", "Answer in JSON:"]):
        ids = sched.tokenizer.encode(prompt)
        sched.submit(f"re-{j}", ids, max_new_tokens=40, temperature=temperature, seed=j, regex=REGEX)
        sched.submit(f"ebnf-{j}", ids, max_new_tokens=40, temperature=temperature, seed=j, ebnf=EBNF)
    json_ids = sched.tokenizer.encode("Answer in JSON:")
    for i, schema in enumerate(schemas):
        sched.submit(
            f"json{i}",
            json_ids,
            max_new_tokens=300,
            temperature=temperature,
            seed=i,
            json_schema=json.dumps(schema),
        )
    results = sched.run_until_idle()
    sched.step()  # an idle step runs the leak self-check
    assert sched.check_memory_leak() is None, sched.check_memory_leak()
    sched.close()
    assert len(results) == 6 + len(schemas)
    for rid, res in results.items():
        assert res.finish_reason["type"] == "stop", (rid, res.finish_reason, res.text)
        if rid.startswith("json"):
            jsonschema.validate(json.loads(res.text), schemas[int(rid[4:])])
        else:
            assert re.fullmatch(REGEX if rid.startswith("re") else EBNF_RE, res.text), (rid, res.text)
