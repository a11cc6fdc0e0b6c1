"""Every cross-process message survives pickle (ZMQ send_pyobj) and msgspec round trips."""

from __future__ import annotations

import dataclasses
import pickle

import msgspec
import pytest

from radixserve.managers import io_struct as io
from radixserve.sampling.sampling_params import SamplingParams

MESSAGES = [
    io.TokenizedGenerateReqInput(
        "r1", "hi", [1, 2, 3], SamplingParams(max_new_tokens=4, stop=["x"]), True, 0, 2, True, 3, 1.5
    ),
    io.BatchTokenizedGenerateReqInput([io.TokenizedGenerateReqInput("r2", "", [4], SamplingParams())]),
    io.TokenizedGenerateReqInput(
        "r3",
        "",
        [5],
        SamplingParams(),
        trace=io.TraceContext("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"),
    ),
    io.AbortReq("abc"),
    io.AbortReq(abort_all=True),
    io.FlushCacheReqInput(),
    io.ControlOutcome(False, "busy", answers="FlushCacheReqInput"),
    io.GetInternalStateReq(),
    io.GetInternalStateReqOutput({"num_running_reqs": 1, "token_usage": 0.5}),
    io.GetDashboardStateReq(max_rows=3),
    io.GetDashboardStateReqOutput({"dp_rank": 0, "batches": [{"mode": "decode", "ms": 1.5}], "requests": []}),
    io.BatchTokenIDOut(
        rids=["a", "b"],
        finished_reasons=[None, io.FinishMatchedToken(2)],
        output_ids=[[1], [2, 3]],
        prompt_tokens=[3, 4],
        completion_tokens=[1, 2],
        cached_tokens=[0, 2],
        skip_special_tokens=[True, False],
        spaces_between_special_tokens=[True, True],
        no_stop_trim=[False, False],
        stop_strs=[[], ["</s>"]],
        traces=[None, io.ReqTrace(1.0, 1.5, ((1.5, 2.0, 3),), 2.0, 2.5, 1, 2.6)],
        output_token_logprobs_val=[[-0.1], [-0.2, -0.3]],
        output_token_logprobs_idx=[[1], [2, 3]],
        output_top_logprobs_val=[[], []],
        output_top_logprobs_idx=[[], []],
        input_token_logprobs_val=[[], [-1.0]],
        input_token_logprobs_idx=[[], [7]],
    ),
    io.BatchStrOut(
        rids=["a"],
        finished_reasons=[io.FinishAbort("m", 503, partial_char_dropped=True)],
        output_strs=["hello"],
        output_ids=[[5]],
        prompt_tokens=[1],
        completion_tokens=[1],
        cached_tokens=[0],
    ),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_pickle_round_trip(msg):
    assert pickle.loads(pickle.dumps(msg)) == msg


# msgspec decodes a union of dataclasses only as tagged msgspec Structs, so the messages carrying
# typed FinishReason objects are pickle-only (ZMQ send_pyobj: pickle is the wire format).
@pytest.mark.parametrize(
    "msg",
    [m for m in MESSAGES if not hasattr(m, "finished_reasons")],
    ids=lambda m: type(m).__name__,
)
def test_msgspec_round_trip(msg):
    data = msgspec.msgpack.encode(msg)
    assert msgspec.msgpack.decode(data, type=type(msg)) == msg


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_frozen(msg):
    fields = dataclasses.fields(msg)
    if fields:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(msg, fields[0].name, None)


def test_dispatcher_routes_by_type_and_rejects_unknown():
    seen = []
    dispatch = io.TypeBasedDispatcher(
        [(io.AbortReq, seen.append), (io.FlushCacheReqInput, lambda m: "flushed")]
    )
    dispatch(io.AbortReq("x"))
    assert seen == [io.AbortReq("x")]
    assert dispatch(io.FlushCacheReqInput()) == "flushed"
    with pytest.raises(ValueError):
        dispatch(object())


def test_rid_matches_the_rid_and_its_samples_only():
    assert io.rid_matches("job", "job") and io.rid_matches("job-0", "job") and io.rid_matches("job-12", "job")
    assert not io.rid_matches("job-extra", "job") and not io.rid_matches("jobs", "job")
    assert not io.rid_matches("x-10", "x-1") and io.rid_matches("x-1-0", "x-1")
    assert not io.rid_matches("anything", "")


@pytest.mark.parametrize("cls", [io.BatchTokenIDOut, io.BatchStrOut])
def test_step_outputs_pickle_keeps_every_field(cls):
    """StepOutputs pickles as (class, field values): every field, set to a value of its own
    (defaults included), comes back, and the copy stays frozen."""
    values = {f.name: [f"{f.name}-value"] for f in dataclasses.fields(cls)}
    values["dp_rank"] = 3
    msg = cls(**values)
    copy = pickle.loads(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
    assert type(copy) is cls and copy == msg
    assert {f.name: getattr(copy, f.name) for f in dataclasses.fields(cls)} == values
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.rids = []  # type: ignore[misc]
