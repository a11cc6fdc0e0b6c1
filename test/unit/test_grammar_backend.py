"""Grammar keys, the bitmask -> bool mask conversion, the bounded-string schema fix and the
TokenizerManager's up-front validation."""

from __future__ import annotations

import pytest
import torch

from radixserve.constrained.grammar_backend import ANY_JSON, fix_string_lengths, grammar_key
from radixserve.constrained.grammar_manager import unpack_bitmask
from radixserve.sampling.sampling_params import SamplingParams


def test_grammar_key_order() -> None:
    assert grammar_key(SamplingParams()) is None
    assert grammar_key(SamplingParams(json_schema="{}")) == ("json", "{}")
    assert grammar_key(SamplingParams(regex="a+")) == ("regex", "a+")
    assert grammar_key(SamplingParams(ebnf='root ::= "a"')) == ("ebnf", 'root ::= "a"')


def test_unpack_bitmask_matches_bit_layout() -> None:
    vocab = 70
    allowed = torch.rand(3, vocab) < 0.5  # [bs, vocab]
    words = (vocab + 31) // 32
    bitmask = torch.zeros(3, words, dtype=torch.int64)
    for b in range(3):
        for t in allowed[b].nonzero().flatten().tolist():
            bitmask[b, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(bitmask >= 1 << 31, bitmask - (1 << 32), bitmask).to(torch.int32)  # as int32 bits
    assert torch.equal(unpack_bitmask(bitmask, vocab), allowed)


def test_fix_string_lengths_only_touches_bounded_strings() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "minLength": 2, "maxLength": 5},
            "b": {"type": "string"},
            "c": {"type": "string", "maxLength": 3, "pattern": "x+"},
            "d": {"type": "array", "items": {"type": "string", "maxLength": 1}},
        },
        "default": {"type": "string", "maxLength": 1},
    }
    fixed = fix_string_lengths(schema)
    props = fixed["properties"]
    assert props["a"] == {"type": "string", "pattern": "^[ !#-\\[\\]-~]{2,5}$"}
    assert props["b"] == {"type": "string"} and props["c"] == schema["properties"]["c"]
    assert props["d"]["items"]["pattern"].endswith("{0,1}$")
    assert fixed["default"] == schema["default"]  # data, not a schema


def test_validation_messages() -> None:
    pytest.importorskip("xgrammar")
    from radixserve.constrained.validation import validate_grammar

    validate_grammar(SamplingParams(json_schema=ANY_JSON))
    validate_grammar(SamplingParams(json_schema='{"type": "object"}'))
    validate_grammar(SamplingParams(regex=r"\d+"))
    for params, needle in [
        (SamplingParams(json_schema="{nope"), "not valid JSON"),
        (SamplingParams(json_schema="[1]"), "object or boolean"),
        (SamplingParams(json_schema='{"type": "objectx"}'), "objectx"),
        (SamplingParams(regex="(a"), "parenthesis"),
        (SamplingParams(ebnf="root ::= missing"), "missing"),
    ]:
        with pytest.raises(ValueError, match=needle):
            validate_grammar(params)
