"""SamplingParams: defaults, normalize(), verify() messages, from_dict() validation."""

import dataclasses

import pytest

from radixserve.sampling.sampling_params import SEED_MAX, TOP_K_ALL, SamplingParams

VOCAB = 100


def test_defaults_match_sglang():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.min_new_tokens == 0 and p.stop is None and p.stop_token_ids is None
    assert p.ignore_eos is False and p.skip_special_tokens is True
    assert p.spaces_between_special_tokens is True and p.no_stop_trim is False
    assert p.n == 1 and p.seed is None
    assert p.json_schema is None and p.regex is None and p.ebnf is None
    p.verify(VOCAB)


def test_normalize_greedy_stop_and_top_k():
    p = SamplingParams(temperature=0.0, stop="END")
    p.normalize()
    assert p.top_k == 1 and p.temperature == 1.0 and p.stop == ["END"]
    p.normalize()  # idempotent
    assert p.top_k == 1 and p.temperature == 1.0 and p.stop == ["END"]
    p.verify(VOCAB)

    q = SamplingParams(temperature=0.7)
    q.normalize()
    assert q.top_k == TOP_K_ALL and q.temperature == 0.7
    q.verify(VOCAB)

    tiny = SamplingParams(temperature=1e-8, top_k=5)
    tiny.normalize()
    assert tiny.top_k == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature must be in [0, 10000], got -0.1."),
        ({"temperature": 1e5}, "temperature must be in [0, 10000], got 100000.0."),
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan."),
        ({"temperature": float("inf")}, "temperature must be a finite number, got inf."),
        ({"top_p": float("nan")}, "top_p must be a finite number, got nan."),
        ({"min_p": float("-inf")}, "min_p must be a finite number, got -inf."),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a finite number, got nan."),
        ({"presence_penalty": float("inf")}, "presence_penalty must be a finite number, got inf."),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number, got nan."),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
        ({"top_k": -2}, "top_k must be -1 (disable) or at least 1, got -2."),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1."),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1."),
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5."),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5."),
        ({"presence_penalty": -3.0}, "presence_penalty must be in [-2, 2], got -3.0."),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in [0.01, 2], got 0.0."),
        ({"repetition_penalty": 1e-30}, "repetition_penalty must be in [0.01, 2], got 1e-30."),
        ({"repetition_penalty": 2.1}, "repetition_penalty must be in [0.01, 2], got 2.1."),
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
        ({"min_new_tokens": -1}, "min_new_tokens must be at least 0, got -1."),
        (
            {"min_new_tokens": 10, "max_new_tokens": 5},
            "min_new_tokens must be in [0, max_new_tokens(5)], got 10.",
        ),
        ({"n": 0}, "n must be at least 1, got 0."),
        (
            {"regex": "a+", "ebnf": "root ::= 'a'"},
            "Only one of json_schema, regex, ebnf, structural_tag can be set, got regex, ebnf.",
        ),
        ({"stop_token_ids": [3, VOCAB]}, f"stop_token_ids must be in [0, {VOCAB}), got {VOCAB}."),
        ({"stop_token_ids": [-1]}, f"stop_token_ids must be in [0, {VOCAB}), got -1."),
    ],
)
def test_verify_messages(kwargs, message):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs).verify(VOCAB)
    assert str(exc.value) == message


def test_verify_accepts_boundaries():
    SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=VOCAB * 10,
        min_p=1.0,
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        repetition_penalty=2.0,
        max_new_tokens=0,
        min_new_tokens=0,
        stop_token_ids=[0, VOCAB - 1],
        json_schema="{}",
    ).verify(VOCAB)


def test_from_dict_roundtrip_and_conversion():
    p = SamplingParams.from_dict(
        {"temperature": 1, "top_k": 5, "stop": "x", "stop_token_ids": [1, 2], "seed": -3}
    )
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert p.top_k == 5 and p.stop == ["x"] and p.stop_token_ids == [1, 2] and p.seed == -3
    assert SamplingParams.from_dict(p.to_dict()) == p
    # Explicit nulls mean "default".
    assert SamplingParams.from_dict({"max_new_tokens": None, "regex": None}) == SamplingParams()


@pytest.mark.parametrize(
    "d, fragment",
    [
        ({"temprature": 0.5}, "Unknown sampling parameter(s): temprature"),
        ({"max_new_tokens": "10"}, "max_new_tokens must be an integer"),
        ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
        ({"top_k": True}, "top_k must be an integer"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": False}, "top_p must be a number"),
        ({"ignore_eos": 1}, "ignore_eos must be a boolean"),
        ({"regex": 3}, "regex must be a string"),
        ({"stop": ["a", 1]}, "stop must be a string or a list of strings"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids must be a list of integers"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of integers"),
        ({"seed": 1.0}, "seed must be an integer"),
    ],
)
def test_from_dict_rejects(d, fragment):
    with pytest.raises(ValueError, match=None) as exc:
        SamplingParams.from_dict(d)
    assert fragment in str(exc.value)


def test_from_dict_rejects_non_object():
    with pytest.raises(ValueError):
        SamplingParams.from_dict([("temperature", 1.0)])


def test_every_field_is_typed_in_from_dict():
    # Each field must round-trip through from_dict with its default value (no AssertionError).
    for f in dataclasses.fields(SamplingParams):
        default = getattr(SamplingParams(), f.name)
        if default is not None:
            SamplingParams.from_dict({f.name: default})


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63, 2**64 + 5, 10**30])
def test_seed_out_of_range_is_refused_with_the_range(seed):
    """Issue 46, 8a: seeds used to be folded mod 2**63, so 2**63 + 5 silently sampled as 5."""
    with pytest.raises(ValueError, match=rf"seed must be in \[0, {SEED_MAX}\], got {seed}\."):
        SamplingParams(seed=seed).verify(VOCAB)


def test_seed_range_is_inclusive():
    assert SEED_MAX == 2**63 - 1
    for seed in (0, 1, SEED_MAX):
        SamplingParams(seed=seed).verify(VOCAB)
