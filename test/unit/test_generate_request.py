"""GenerateReqInput.expand: per-prompt fields (priority included) reach each item, and the
TokenizedGenerateReqInput the scheduler gets carries the priority."""

import asyncio

import pytest

from radixserve.managers.generate_request import GenerateReqInput
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
