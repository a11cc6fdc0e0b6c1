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
    assert grammar_key(SamplingParams(structural_tag="{}")) == ("structural_tag", "{}")


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
        (SamplingParams(structural_tag="[1]"), "JSON object"),
        (SamplingParams(structural_tag='{"structures": [{"begin": "<f>"}], "triggers": []}'), "'end'"),
        (SamplingParams(structural_tag='{"type": "structural_tag", "format": {"type": "nope"}}'), "nope"),
    ]:
        with pytest.raises(ValueError, match=needle):
            validate_grammar(params)


def test_compile_cache_is_bounded_in_entries_and_bytes(tiny_model_dir) -> None:
    """Issue 23's memory growth: the compile cache kept up to 1024 grammars whatever their size.
    It is an LRU bounded in entries and in the compiled grammars' own bytes."""
    from transformers import AutoTokenizer

    from radixserve.constrained.grammar_backend import GrammarBackend
    from radixserve.testing.tiny_models import TINY_VOCAB

    class Compiled:
        memory_size_bytes = 3000

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    by_bytes = GrammarBackend(tokenizer, TINY_VOCAB, (2,), cache_size=100, cache_bytes=10_000)
    by_count = GrammarBackend(tokenizer, TINY_VOCAB, (2,), cache_size=4, cache_bytes=1 << 30)
    for backend in (by_bytes, by_count):
        backend.compile = lambda key: Compiled()  # the cache logic, not xgrammar, is under test
        for k in range(10):
            backend.get_cached_or_future_value(("regex", f"a{k}"))[0].result()
        backend._executor.shutdown(wait=True)  # every done-callback (size accounting) has run
    assert by_bytes.cache_stats() == (3, 9000)
    assert by_count.cache_stats() == (4, 12000)
    for backend, kept in ((by_bytes, 3), (by_count, 4)):
        assert list(backend._cache) == [("regex", f"a{k}") for k in range(10 - kept, 10)]  # the newest


SGLANG_TAG = {
    "type": "structural_tag",
    "structures": [
        {
            "begin": "<f>",
            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            "end": "</f>",
        }
    ],
    "triggers": ["<f>"],
}


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        ('free text <f>{"a": 1}</f> more', True),  # free until the trigger, then the structure
        ("no trigger at all", True),
        ("<f>not json", False),
        ('<f>{"b": 1}</f>', False),  # the schema requires "a"
    ],
)
def test_sglang_structural_tag_constrains_only_after_its_trigger(text: str, accepted: bool) -> None:
    """SGLang's form of the structural tag (structures + triggers), compiled as the backend does."""
    import json

    xgr = pytest.importorskip("xgrammar")
    from radixserve.constrained.grammar_backend import structural_tag_args

    grammar = xgr.Grammar.from_structural_tag(*structural_tag_args(xgr, json.dumps(SGLANG_TAG)))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar)
    assert xgr.GrammarMatcher(compiled).accept_string(text) is accepted
