"""Constrained decoding through the real Scheduler and a tiny random model (the grammar alone makes
its output valid): JSON schemas, regexes, EBNF, the grammar queue, timeouts, aborts, retraction,
overlap on and off, and unconstrained neighbours left untouched."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch

pytest.importorskip("xgrammar")

from radixserve.constrained.grammar_backend import GrammarBackend, GrammarKey  # noqa: E402
from radixserve.testing.inprocess import InProcessScheduler  # noqa: E402
from radixserve.testing.json_schemas import random_schemas  # noqa: E402

PROMPT = "Answer in JSON:"
REGEXES = {
    "date": r"\d{4}-\d{2}-\d{2}",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "yesno": r"(yes|no)",
}
EBNF = 'root ::= "answer: " choice\nchoice ::= "yes" | "no" | num\nnum ::= [0-9] [0-9]?\n'
EBNF_RE = r"answer: (yes|no|[0-9]{1,2})"


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # On the 2-core CI box torch's two OpenMP threads contend with the compile threads (and other
    # test processes); one thread keeps these tests fast and their timing predictable.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Any) -> str:
    return tiny_model_dir("llama")


def make(path: str, grammar_backend: Any = None, **args: Any) -> InProcessScheduler:
    args.setdefault("max_total_tokens", 8192)
    args.setdefault("max_running_requests", 128)
    return InProcessScheduler(path, grammar_backend=grammar_backend, **args)


def finish(sched: InProcessScheduler) -> dict[str, Any]:
    results = sched.run_until_idle()
    sched.step()  # an idle step runs the leak self-check
    assert sched.check_memory_leak() is None, sched.check_memory_leak()
    sched.close()
    return results


def submit_schemas(sched: InProcessScheduler, schemas: list[dict], temps: tuple[float, ...]) -> None:
    prompt = sched.tokenizer.encode(PROMPT)
    for i, schema in enumerate(schemas):
        for t in temps:
            sched.submit(
                f"json{i}-{t}",
                prompt,
                max_new_tokens=400,
                temperature=t,
                seed=i,
                json_schema=json.dumps(schema),
            )


def check_schemas(results: dict[str, Any], schemas: list[dict]) -> None:
    checked = 0
    for rid, res in results.items():
        if not rid.startswith("json"):
            continue
        schema = schemas[int(rid[4:].split("-")[0])]
        assert res.finish_reason["type"] == "stop", (rid, res.finish_reason, res.text)
        jsonschema.validate(json.loads(res.text), schema)
        checked += 1
    assert checked == sum(1 for rid in results if rid.startswith("json"))


@pytest.mark.parametrize("overlap", [True, False])
def test_random_json_schemas(tiny: str, overlap: bool) -> None:
    schemas = random_schemas(seed=1234, count=50)
    sched = make(tiny, disable_overlap_schedule=not overlap)
    submit_schemas(sched, schemas, temps=(0.0, 0.8))
    results = finish(sched)
    assert len(results) == 100
    check_schemas(results, schemas)


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_keeps_outputs_valid(tiny: str, overlap: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A KV pool far too small for the batch: requests are retracted mid-JSON and re-prefilled; the
    matcher must continue exactly where the kept output left off."""
    schemas = random_schemas(seed=99, count=24)
    # Optimistic admission (tiny reservations) into a small pool: running requests outgrow it.
    # Decodes apart from chunks (the CPU default mixes them, and a mixed chunk reserves the
    # riding decodes' pages before it admits, which here leaves nothing to retract).
    sched = make(
        tiny,
        max_total_tokens=500,
        schedule_conservativeness=0.01,
        disable_overlap_schedule=not overlap,
        disable_mixed_chunk=True,
    )
    with caplog.at_level(logging.WARNING, logger="radixserve.scheduler.batch_builder"):
        submit_schemas(sched, schemas, temps=(0.0, 0.8))
        for name, pattern in REGEXES.items():
            sched.submit(f"re-{name}", sched.tokenizer.encode("Say:"), max_new_tokens=40, regex=pattern)
        results = finish(sched)
    assert any("Retract" in r.message for r in caplog.records), "the pool should force retraction"
    check_schemas(results, schemas)
    for name, pattern in REGEXES.items():
        assert re.fullmatch(pattern, results[f"re-{name}"].text), results[f"re-{name}"].text


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_regexes_and_ebnf_fully_match(tiny: str, temperature: float) -> None:
    sched = make(tiny)
    prompts = ["Date:", "Call me at", "Is it?", "Hello world, the quick"]
    for j, prompt in enumerate(prompts):
        ids = sched.tokenizer.encode(prompt)
        for name, pattern in REGEXES.items():
            sched.submit(
                f"{name}-{j}", ids, max_new_tokens=40, temperature=temperature, seed=j, regex=pattern
            )
        sched.submit(f"ebnf-{j}", ids, max_new_tokens=40, temperature=temperature, seed=j, ebnf=EBNF)
    results = finish(sched)
    for rid, res in results.items():
        pattern = EBNF_RE if rid.startswith("ebnf") else REGEXES[rid.split("-")[0]]
        assert res.finish_reason["type"] == "stop", (rid, res.finish_reason)
        assert re.fullmatch(pattern, res.text), (rid, res.text)


def test_structural_tag_format_fully_matches(tiny: str) -> None:
    """xgrammar's structural tag (its own JSON form, SGLang's structural_tag field): a tag whose
    content is a JSON schema, so the whole output is begin + valid JSON + end."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<f>",
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "</f>",
        },
    }
    sched = make(tiny)
    ids = sched.tokenizer.encode(PROMPT)
    for j, t in enumerate((0.0, 0.8, 1.0)):
        sched.submit(
            f"tag-{j}", ids, max_new_tokens=200, temperature=t, seed=j, structural_tag=json.dumps(tag)
        )
    results = finish(sched)
    for rid, res in results.items():
        assert res.finish_reason["type"] == "stop", (rid, res.finish_reason, res.text)
        m = re.fullmatch(r"<f>(.*)</f>", res.text, re.DOTALL)
        assert m is not None, (rid, res.text)
        jsonschema.validate(json.loads(m.group(1)), schema)


def test_unconstrained_neighbours_unchanged(tiny: str) -> None:
    """Greedy unconstrained outputs are identical with and without constrained requests alongside."""
    prompts = [f"Hello world number {i}" for i in range(6)]

    def run(with_constrained: bool) -> dict[str, list[int]]:
        sched = make(tiny)
        for i, p in enumerate(prompts):
            sched.submit(f"plain{i}", sched.tokenizer.encode(p), max_new_tokens=24, ignore_eos=True)
            if with_constrained:
                sched.submit(
                    f"json{i}",
                    sched.tokenizer.encode(p),
                    max_new_tokens=60,
                    temperature=0.8,
                    seed=i,
                    json_schema=json.dumps(random_schemas(i, 1)[0]),
                )
                sched.submit(f"re{i}", sched.tokenizer.encode(p), max_new_tokens=30, regex=REGEXES["date"])
        results = finish(sched)
        return {rid: r.output_ids for rid, r in results.items() if rid.startswith("plain")}

    assert run(with_constrained=True) == run(with_constrained=False)


def test_siblings_have_their_own_matchers(tiny: str) -> None:
    """n > 1 children share one compiled grammar but each advances its own matcher."""
    sched = make(tiny)
    schema = random_schemas(7, 1)[0]
    ids = sched.tokenizer.encode(PROMPT)
    for j in range(4):
        sched.submit(
            f"x-{j}", ids, max_new_tokens=300, temperature=0.8, seed=100 + j, json_schema=json.dumps(schema)
        )
    reqs = list(sched.scheduler.state.live.values())
    results = finish(sched)
    assert len({id(r.grammar) for r in reqs}) == 4 and all(r.grammar is not None for r in reqs)
    texts = [results[f"x-{j}"].text for j in range(4)]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1


def test_invalid_grammars_abort_with_the_compiler_message(tiny: str) -> None:
    sched = make(tiny)
    ids = sched.tokenizer.encode(PROMPT)
    sched.submit("bad-json", ids, json_schema='{"type": "objectx"}')
    sched.submit("bad-json-2", ids, json_schema='{"type": "objectx"}')  # cache hit on the failure
    sched.submit("bad-regex", ids, regex="(abc")
    sched.submit("bad-ebnf", ids, ebnf="root ::= undefined_rule")
    sched.submit("ok", ids, max_new_tokens=8, regex=r"(yes|no)")
    results = finish(sched)
    expected = {
        "bad-json": "objectx",
        "bad-json-2": "objectx",
        "bad-regex": "parenthesis",
        "bad-ebnf": "undefined_rule",
    }
    for rid, needle in expected.items():
        reason = results[rid].finish_reason
        assert reason["type"] == "abort" and reason["status_code"] == 400, reason
        assert needle in reason["message"], reason
    assert results["ok"].text in ("yes", "no")


class SlowBackend(GrammarBackend):
    """Compilation that takes `delay_s` (a stand-in for a pathological schema)."""

    def __init__(self, *args: Any, delay_s: float, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.delay_s = delay_s

    def compile(self, key: GrammarKey) -> Any:
        time.sleep(self.delay_s)
        return super().compile(key)


def slow_backend(sched_path: str, delay_s: float) -> SlowBackend:
    from transformers import AutoTokenizer

    from radixserve.configs.model_config import ModelConfig

    config = ModelConfig.from_path(sched_path)
    return SlowBackend(
        AutoTokenizer.from_pretrained(sched_path), config.vocab_size, config.eos_token_ids, delay_s=delay_s
    )


def test_compile_timeout_aborts_and_server_keeps_serving(tiny: str) -> None:
    sched = make(tiny, grammar_backend=slow_backend(tiny, delay_s=1.0), grammar_compile_timeout=0.2)
    ids = sched.tokenizer.encode(PROMPT)
    sched.submit("slow", ids, regex=r"\d+")
    sched.submit("plain", ids, max_new_tokens=5, ignore_eos=True)
    results = finish(sched)
    reason = results["slow"].finish_reason
    assert reason["type"] == "abort" and "timed out" in reason["message"], reason
    assert len(results["plain"].output_ids) == 5


def test_abort_while_compiling(tiny: str) -> None:
    sched = make(tiny, grammar_backend=slow_backend(tiny, delay_s=0.5))
    sched.submit("victim", sched.tokenizer.encode(PROMPT), regex=r"\d+")
    sched.step()
    assert len(sched.scheduler.grammar.grammar_queue) == 1
    sched.abort("victim")
    results = finish(sched)
    assert results["victim"].finish_reason["type"] == "abort"
    assert not sched.scheduler.grammar.grammar_queue


def test_chunked_prefill_and_mixed_chunk(tiny: str) -> None:
    """Middle chunks sample a throwaway token: the matcher must not see it."""
    sched = make(tiny, chunked_prefill_size=16, enable_mixed_chunk=True)
    long_prompt = sched.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    for i in range(4):
        sched.submit(f"d{i}", long_prompt + [i + 3], max_new_tokens=30, regex=REGEXES["date"])
        sched.submit(f"p{i}", long_prompt, max_new_tokens=10, ignore_eos=True)
    results = finish(sched)
    for i in range(4):
        assert re.fullmatch(REGEXES["date"], results[f"d{i}"].text), results[f"d{i}"].text


def test_grammar_and_penalties_match_between_loops(tiny: str) -> None:
    """Greedy outputs of constrained and penalized requests (and free neighbours) are identical in
    the normal loop (the reference) and the overlap loop, where such batches sample delayed: their
    forward overlaps with processing the previous batch, their sample waits for its tokens."""
    schemas = random_schemas(seed=7, count=10)
    penalties = [
        {},
        {"frequency_penalty": 0.8},
        {"presence_penalty": 1.0},
        {"repetition_penalty": 1.5},
        {"min_new_tokens": 3, "frequency_penalty": -0.5},
    ]
    outputs = {}
    for overlap in (False, True):
        sched = make(tiny, disable_overlap_schedule=not overlap)
        prompt = sched.tokenizer.encode(PROMPT)
        for i, schema in enumerate(schemas):
            params = penalties[i % len(penalties)]
            sched.submit(f"json{i}", prompt, max_new_tokens=300, json_schema=json.dumps(schema), **params)
            sched.submit(
                f"free{i}", prompt + [i + 5], max_new_tokens=24, **penalties[(i + 1) % len(penalties)]
            )
            name = list(REGEXES)[i % len(REGEXES)]
            sched.submit(
                f"re{i}", sched.tokenizer.encode("Say:"), max_new_tokens=40, regex=REGEXES[name], **params
            )
            sched.step()  # arrivals spread over steps: batches merge while others are in flight
        results = finish(sched)
        outputs[overlap] = {rid: (r.output_ids, r.finish_reason) for rid, r in results.items()}
        check_schemas(results, schemas)
    assert outputs[True] == outputs[False]
