"""GenerateReqInput.expand: per-prompt fields (priority included) reach each item, and the
TokenizedGenerateReqInput the scheduler gets carries the priority; the per-request limits; the
checks that need the token ids (input_validation.prepare_items)."""

import asyncio

import pytest

from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.input_validation import ModelLimits, prepare_items
from radixserve.managers.req_state import ReqState
from radixserve.managers.tokenizer_manager import TokenizerManager


def test_priority_per_prompt_reaches_the_scheduler_message():
    obj = GenerateReqInput(
        text=["a", "b"], rid=["r0", "r1"], priority=[5, -1], sampling_params=[{"n": 2}, {}]
    )
    items = obj.expand()
    assert [(i.rid, i.priority) for i in items] == [("r0-0", 5), ("r0-1", 5), ("r1", -1)]
    msg = TokenizerManager._tokenized(ReqState(items[2], [1, 2], asyncio.Event()), False, 0.0)
    assert msg.priority == -1 and msg.rid == "r1"
    assert GenerateReqInput(text="a").expand()[0].priority is None


@pytest.mark.parametrize(
    "body, message",
    [
        ({"text": ["a", "b"], "priority": [1]}, "'priority' has 1 entries for 2 prompts"),
        ({"text": "a", "priority": [1]}, "must not be a list for a single prompt"),
        ({"text": ["a", "b"], "rid": "same"}, "one id per prompt"),
    ],
)
def test_shape_errors(body, message):
    with pytest.raises(ValueError, match=message):
        GenerateReqInput(**body).expand()


@pytest.mark.parametrize(
    "body, message",
    [
        ({"text": "a", "sampling_params": {"n": 129}}, r"n must be in \[1, 128\], got 129"),
        ({"text": "a", "sampling_params": {"n": 0}}, r"n must be in \[1, 128\], got 0"),
        ({"text": "a", "top_logprobs_num": 21}, r"top_logprobs_num must be in \[0, 20\], got 21"),
        ({"text": "a", "top_logprobs_num": -1}, r"top_logprobs_num must be in \[0, 20\], got -1"),
        ({"text": ["a", "b"], "top_logprobs_num": [1, 100000]}, "got 100000"),
        ({"text": "a", "logprob_start_len": -7}, "logprob_start_len must be -1 or at least 0, got -7"),
        ({"text": "a", "rid": "r" * 257}, "at most 256 characters, got 257"),
        ({"text": ["a", "b"], "rid": ["x", "r" * 1_000_000]}, "at most 256 characters"),
    ],
)
def test_limits_per_request(body, message):
    with pytest.raises(ValueError, match=message):
        GenerateReqInput(**body).expand()


def test_seed_and_its_samples_must_fit_the_sampler():
    """Issue 46, 8a: sample j uses seed + j, so with n samples the last seed must fit too."""
    top = 2**63 - 1
    seeds = [
        i.sampling_params.seed
        for i in GenerateReqInput(text="a", sampling_params={"n": 3, "seed": top - 2}).expand()
    ]
    assert seeds == [top - 2, top - 1, top]
    with pytest.raises(
        ValueError, match=rf"seed must be in \[0, {top - 2}\] \(n=3: sample j uses seed \+ j\), got {top - 1}"
    ):
        GenerateReqInput(text="a", sampling_params={"n": 3, "seed": top - 1}).expand()
    with pytest.raises(ValueError, match=rf"seed must be in \[0, {top}\], got {2**63}\."):
        GenerateReqInput(text="a", sampling_params={"seed": 2**63}).expand()
    with pytest.raises(ValueError, match=r"seed must be in \[0, \d+\], got -1\."):
        GenerateReqInput(text="a", sampling_params={"seed": -1}).expand()


def test_limits_are_inclusive():
    body = {"text": "a", "rid": "r" * 256, "top_logprobs_num": 20, "logprob_start_len": -1}
    assert len(GenerateReqInput(**body, sampling_params={"n": 128}).expand()) == 128


def _prepare(**fields):
    items = GenerateReqInput(input_ids=[5, 6, 7], **fields).expand()
    return prepare_items(None, ModelLimits(vocab_size=100, context_len=64, max_req_input_len=63), items)


def test_logprob_start_len_must_be_inside_the_prompt():
    """SGLang's rule: -1 (no prompt logprobs) or a position of the prompt; only checked when
    logprobs are asked for (SGLang ignores the field otherwise)."""
    for start in (-1, 0, 2):
        assert _prepare(return_logprob=True, logprob_start_len=start) == [[5, 6, 7]]
    for start in (3, 1000000):
        with pytest.raises(ValueError, match=rf"logprob_start_len \({start}\) must be less than .* \(3\)"):
            _prepare(return_logprob=True, logprob_start_len=start)
    assert _prepare(logprob_start_len=1000000) == [[5, 6, 7]]


def test_samples_of_a_prompt_share_one_tokenization():
    calls = []

    class Tok:
        def encode(self, text):
            calls.append(text)
            return [1, 2]

    items = GenerateReqInput(text=["a", "b"], sampling_params=[{"n": 3}, {}]).expand()
    ids = prepare_items(Tok(), ModelLimits(vocab_size=10, context_len=64, max_req_input_len=63), items)
    assert ids == [[1, 2]] * 4 and calls == ["a", "b"]


@pytest.mark.parametrize("allow", [False, True])
def test_allow_auto_truncate_cuts_the_input_and_the_budget_instead_of_refusing(allow):
    """--allow-auto-truncate (SGLang): an input past the context keeps its first tokens, and a
    max_new_tokens past what is left shrinks to it; without the flag both are 400s."""
    limits = ModelLimits(vocab_size=100, context_len=16, max_req_input_len=15, allow_auto_truncate=allow)
    long_input = GenerateReqInput(
        input_ids=list(range(1, 30)), sampling_params={"max_new_tokens": 1}
    ).expand()
    big_budget = GenerateReqInput(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 50}).expand()
    if not allow:
        with pytest.raises(ValueError, match="longer than the model's context length"):
            prepare_items(None, limits, long_input)
        with pytest.raises(ValueError, match="exceeds the model's maximum context length of 16"):
            prepare_items(None, limits, big_budget)
        return
    assert prepare_items(None, limits, long_input) == [list(range(1, 16))]
    assert long_input[0].sampling_params.max_new_tokens == 1
    assert prepare_items(None, limits, big_budget) == [[5, 6, 7]]
    assert big_budget[0].sampling_params.max_new_tokens == 13


@pytest.mark.parametrize(
    "body, field",
    [
        ('{"text": "a", "video_data": "https://example.com/cat.mp4"}', "video_data"),
        ('{"text": "a", "audio_data": ["x"]}', "audio_data"),
        ('{"text": "a", "positional_embed_overrides": [[0.5]]}', "positional_embed_overrides"),
        ('{"text": "a", "return_entropy": true}', "return_entropy"),
        ('{"text": "a", "max_thinking_tokens": 0}', "max_thinking_tokens"),  # 0 is a budget, not "off"
    ],
)
def test_sglang_fields_the_server_cannot_honour_are_refused(body: str, field: str) -> None:
    """A 400 naming the field, never an answer that silently left it out (issue 42)."""
    with pytest.raises(ValueError, match=f"'{field}' is not supported"):
        GenerateReqInput.model_validate_json(body, strict=True)


def test_off_values_and_ignorable_hints_are_accepted() -> None:
    body = (
        '{"text": "a", "image_data": null, "modalities": [], "return_entropy": false, '
        '"log_metrics": true, "custom_labels": {"team": "x"}, "routing_key": "k", "no_logs": true}'
    )
    item = GenerateReqInput.model_validate_json(body, strict=True).expand()[0]
    assert item.text == "a" and item.no_logs


def test_only_the_server_marks_a_health_probe() -> None:
    """/health_generate's probe is marked by the server (a private attribute); a body cannot."""
    probe = GenerateReqInput(input_ids=[0])
    probe._health_check = True
    assert probe.expand()[0].health_check
    forged = GenerateReqInput.model_validate_json('{"input_ids": [0], "_health_check": true}', strict=True)
    assert not forged.expand()[0].health_check
