"""stop_regex (SGLang's FINISHED_MATCHED_REGEX): the scheduler's Req finishes on the first pattern
matched by text that the newest token ends; the detokenizer keeps the matched text."""

from __future__ import annotations

import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from radixserve.managers.detokenizer_manager import DetokenizerManager
from radixserve.managers.io_struct import BatchTokenIDOut, FinishMatchedRegex
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.scheduler.req import Req
from req_factory import make_req

TEXT = "Order 12 apples, then 345 pears. Answer: 42.\n\nDone"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def finish_step(tokenizer: PreTrainedTokenizerFast, text: str, **params: object) -> tuple[int | None, Req]:
    """Feed `text`'s tokens one by one; the index of the token the request finished on."""
    sampling = SamplingParams(max_new_tokens=1000, **params)
    sampling.normalize()
    req = make_req("r", [0], sampling, tokenizer=tokenizer)
    for i, tok in enumerate(tokenizer.encode(text)):
        req.output_ids.append(tok)
        req.check_finished()
        if req.finished_reason is not None:
            return i, req
    return None, req


def test_stops_on_the_token_that_completes_the_first_match(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(TEXT)
    step, req = finish_step(tokenizer, TEXT, stop_regex=r"Answer: \d+\.")
    assert step is not None
    assert req.finished_reason == FinishMatchedRegex(r"Answer: \d+\.")
    assert req.finished_reason.to_json() == {"type": "stop", "matched": r"Answer: \d+\."}
    # The text up to that token holds the match; one token less does not.
    assert re.search(r"Answer: \d+\.", tokenizer.decode(ids[: step + 1]))
    assert not re.search(r"Answer: \d+\.", tokenizer.decode(ids[:step]))


def test_the_first_pattern_to_match_wins_and_a_string_is_a_list(tokenizer: PreTrainedTokenizerFast) -> None:
    step_two, req = finish_step(tokenizer, TEXT, stop_regex=[r"\n\n", r"\d{3}"])
    assert req.finished_reason == FinishMatchedRegex(r"\d{3}")  # "345" comes before the blank line
    step_one, req = finish_step(tokenizer, TEXT, stop_regex=r"\n\n")
    assert req.finished_reason == FinishMatchedRegex(r"\n\n") and step_one > step_two


def test_a_match_before_min_new_tokens_does_not_count_later(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(TEXT)
    first_digit = next(i for i, t in enumerate(ids) if any(c.isdigit() for c in tokenizer.decode([t])))
    step, req = finish_step(tokenizer, TEXT, stop_regex=r"\d", min_new_tokens=first_digit + 2)
    # "12" lies before min_new_tokens; the next digit after it stops the request.
    assert step is not None and step > first_digit + 1
    assert any(c.isdigit() for c in tokenizer.decode(ids[step : step + 1]))


def test_stop_strings_are_checked_first_and_no_match_runs_on(tokenizer: PreTrainedTokenizerFast) -> None:
    _, req = finish_step(tokenizer, TEXT, stop=["apples"], stop_regex=r"apples")
    assert req.finished_reason.to_json() == {"type": "stop", "matched": "apples"}
    step, req = finish_step(tokenizer, TEXT, stop_regex=r"bananas")
    assert step is None and req.finished_reason is None


def test_the_detokenizer_keeps_the_matched_text(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(TEXT)
    step, _ = finish_step(tokenizer, TEXT, stop_regex=r"Answer: \d+\.")
    assert step is not None
    reason = FinishMatchedRegex(r"Answer: \d+\.")
    msg = BatchTokenIDOut(
        rids=["r"],
        finished_reasons=[reason],
        output_ids=[ids[: step + 1]],
        prompt_tokens=[1],
        completion_tokens=[step + 1],
        cached_tokens=[0],
        skip_special_tokens=[True],
        spaces_between_special_tokens=[True],
        no_stop_trim=[False],
        stop_strs=[[]],
    )
    out = DetokenizerManager(tokenizer).handle(msg)
    assert out.output_strs == [tokenizer.decode(ids[: step + 1])]
    assert out.output_strs[0].endswith("Answer: 42.")


@pytest.mark.parametrize(
    ("value", "message"),
    [("(unclosed", "Invalid stop_regex"), ("a*", "matches the empty string"), (["ok", "[z-a]"], "Invalid")],
)
def test_bad_patterns_are_refused(value: object, message: str) -> None:
    params = SamplingParams.from_dict({"stop_regex": value})
    params.normalize()
    with pytest.raises(ValueError, match=message):
        params.verify(100)


@pytest.mark.parametrize("value", [5, [1, "a"], {"a": 1}])
def test_patterns_of_the_wrong_type_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match="stop_regex must be a string or a list of strings"):
        SamplingParams.from_dict({"stop_regex": value})
