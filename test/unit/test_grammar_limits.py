"""Nesting limits on grammars (issue 46, item 2): a json_schema nested ~1,000 levels deep made the
up-front validation raise RecursionError (a plain-text HTTP 500); deep regexes and EBNF grammars
got xgrammar's bare "Nest layer exceeded". Each is now a ValueError (HTTP 400) naming the limit,
found in linear time without recursion, in the TokenizerManager and again in the scheduler."""

from __future__ import annotations

import json

import pytest

from radixserve.constrained.grammar_backend import InvalidGrammar
from radixserve.constrained.grammar_limits import (
    _EBNF_TOKENS,
    _JSON_TOKENS,
    _REGEX_TOKENS,
    MAX_GROUP_DEPTH,
    MAX_JSON_SCHEMA_DEPTH,
    nesting_depth,
    nesting_error,
)
from radixserve.sampling.sampling_params import SamplingParams


def nested_objects(levels: int) -> str:
    """A schema with `levels` nested object properties (2 JSON levels each, plus the leaf)."""
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


def nested_arrays(levels: int) -> str:
    return '{"type":"array","items":' * levels + '{"type":"string"}' + "}" * levels


def test_depth_counts_brackets_outside_strings_and_classes() -> None:
    assert nesting_depth('{"a": [1, {"b": "[[[{{{"}]}', _JSON_TOKENS) == 3
    assert nesting_depth(r'{"k\"[": "\\"}', _JSON_TOKENS) == 1  # escaped quotes inside keys/values
    assert nesting_depth(r"(a(b)\(\(\()[(((]", _REGEX_TOKENS) == 2
    assert nesting_depth(r"[\]((]((x))", _REGEX_TOKENS) == 2
    ebnf = 'root ::= ("(((" | [(]) # ((((\nx ::= ((("a"))'
    assert nesting_depth(ebnf, _EBNF_TOKENS) == 3
    assert nesting_depth(json.dumps({"a": [[[[1]]]]}), _JSON_TOKENS) == 5


def test_limits_at_the_boundary() -> None:
    assert nesting_error("json", "[" * MAX_JSON_SCHEMA_DEPTH + "]" * MAX_JSON_SCHEMA_DEPTH) is None
    deep = "[" * (MAX_JSON_SCHEMA_DEPTH + 1) + "]" * (MAX_JSON_SCHEMA_DEPTH + 1)
    assert nesting_error("json", deep) == (
        f"Invalid json_schema: nested deeper than the limit of {MAX_JSON_SCHEMA_DEPTH} levels "
        "(objects and arrays)."
    )
    assert nesting_error("regex", "(" * MAX_GROUP_DEPTH + "a" + ")" * MAX_GROUP_DEPTH) is None
    assert "limit of 64 levels (parentheses)" in str(nesting_error("regex", "(" * 65 + "a" + ")" * 65))
    assert nesting_error("ebnf", "root ::= " + "(" * 65 + '"a"' + ")" * 65).startswith("Invalid ebnf:")


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        (
            SamplingParams(json_schema=nested_objects(1000)),
            "json_schema: nested deeper than the limit of 128",
        ),
        (SamplingParams(json_schema="[" * 100_000), "json_schema: nested deeper than the limit of 128"),
        (SamplingParams(json_schema=nested_arrays(5000)), "json_schema: nested deeper"),
        (SamplingParams(regex="(" * 5000 + "a" + ")" * 5000), "regex: nested deeper than the limit of 64"),
        (SamplingParams(ebnf="root ::= " + "(" * 5000 + '"a"' + ")" * 5000), "ebnf: nested deeper"),
    ],
)
def test_validation_refuses_deep_grammars(params: SamplingParams, needle: str) -> None:
    from radixserve.constrained.validation import validate_grammar

    with pytest.raises(ValueError, match=needle):
        validate_grammar(params)


def test_validation_accepts_schemas_at_the_documented_depth() -> None:
    """About 64 nested objects fit (docs/structured_outputs.md); xgrammar takes ~0.1 s for it."""
    pytest.importorskip("xgrammar")
    from radixserve.constrained.validation import validate_grammar

    validate_grammar(SamplingParams(json_schema=nested_objects(63)))
    with pytest.raises(ValueError, match="limit of 128"):
        validate_grammar(SamplingParams(json_schema=nested_objects(64)))


def test_scheduler_compile_refuses_deep_grammars_without_compiling(tiny_model_dir) -> None:
    """A deep spec that reaches the scheduler anyway is an InvalidGrammar (an abort with the
    message), never a compile that recurses or holds a compile thread for minutes."""
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from radixserve.constrained.grammar_backend import GrammarBackend
    from radixserve.testing.tiny_models import TINY_VOCAB

    backend = GrammarBackend(AutoTokenizer.from_pretrained(tiny_model_dir("llama")), TINY_VOCAB, (2,))

    def never(key: tuple[str, str]) -> None:
        raise AssertionError(f"compiled {key[0]}")

    backend.compile = never
    try:
        for key in (("json", nested_objects(1000)), ("regex", "(" * 100 + ")" * 100)):
            value = backend.get_cached_or_future_value(key)[0].result(timeout=10)
            assert isinstance(value, InvalidGrammar) and "nested deeper than the limit" in value.message
    finally:
        backend.shutdown()
