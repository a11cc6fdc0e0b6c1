"""radixserve.Engine over the fake scheduler: sync, async, streaming, batches, shutdown."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_scheduler import run_fake_scheduler, write_tiny_tokenizer  # noqa: E402

from radixserve.entrypoints.engine import Engine  # noqa: E402
from radixserve.sampling.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    tok_dir = str(tmp_path_factory.mktemp("tok"))
    write_tiny_tokenizer(tok_dir)
    with Engine(model_path=tok_dir, scheduler_entry=run_fake_scheduler) as eng:
        yield eng
    assert all(not p.is_alive() for p in eng._children.procs)


def test_generate_single_and_batch(engine: Engine) -> None:
    out = engine.generate("Hello world", {"max_new_tokens": 4})
    assert out["text"] == "Hello worldHello world"
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"} <= set(meta)
    outs = engine.generate(["Hello", "world"], [{"max_new_tokens": 1}, {"max_new_tokens": 2}])
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [1, 2]
    assert outs[0]["text"] == "Hello" and outs[1]["text"].startswith("w")


def test_logprobs_and_input_ids(engine: Engine) -> None:
    out = engine.generate(
        input_ids=[67, 68],
        sampling_params={"max_new_tokens": 2},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    )
    meta = out["meta_info"]
    assert [t[1] for t in meta["output_token_logprobs"]] == [67, 68]
    assert len(meta["output_top_logprobs"][0]) == 2 and len(meta["input_token_logprobs"]) == 2
    assert all(t[2] is None for t in meta["output_token_logprobs"])  # no text unless asked
    named = engine.generate(
        input_ids=[67, 68],
        sampling_params={"max_new_tokens": 2},
        return_logprob=True,
        return_text_in_logprobs=True,
    )
    texts = [t[2] for t in named["meta_info"]["output_token_logprobs"]]
    assert texts == [engine.tokenizer_manager.tokenizer.decode([t]) for t in (67, 68)]


def test_stream_and_async(engine: Engine) -> None:
    chunks = list(engine.generate("Hello", {"max_new_tokens": 3}, stream=True))
    assert chunks[-1]["text"] == "HelloHelloHello" and chunks[-1]["meta_info"]["finish_reason"] is not None

    async def main() -> tuple[dict, list[dict]]:
        single = await engine.async_generate("abc", {"max_new_tokens": 2})
        stream = await engine.async_generate("abc", {"max_new_tokens": 2}, stream=True)
        return single, [c async for c in stream]

    single, streamed = asyncio.run(main())
    assert single["text"] == streamed[-1]["text"]


def test_invalid_request_raises_value_error(engine: Engine) -> None:
    with pytest.raises(ValueError):
        engine.generate("Hello", {"temperature": -1.0})


def test_sampling_params_object_budget_shrinks_to_fit_like_a_dict(engine: Engine) -> None:
    """A SamplingParams object's default max_new_tokens (128) counts as unset, as an omitted key
    does: a 200-token prompt in the fake's 256-token context gets the 56 that fit, not an error."""
    prompt = list(range(60, 70)) * 20
    as_dict = engine.generate(input_ids=prompt, sampling_params={})
    as_object = engine.generate(input_ids=prompt, sampling_params=SamplingParams())
    assert as_object["meta_info"]["completion_tokens"] == as_dict["meta_info"]["completion_tokens"] == 56
    with pytest.raises(ValueError, match="maximum context length"):
        engine.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=100))


@pytest.mark.parametrize("level", [0, 3])
def test_log_requests(tmp_path: object, caplog: pytest.LogCaptureFixture, level: int) -> None:
    """--log-requests logs each request when received and when finished, with the detail of
    --log-requests-level (0: metadata only; 3: also sampling params, whole input and output)."""
    import logging

    tok_dir = str(tmp_path)
    write_tiny_tokenizer(tok_dir)
    with caplog.at_level(logging.INFO, logger="radixserve.requests"):
        with Engine(
            model_path=tok_dir,
            scheduler_entry=run_fake_scheduler,
            log_requests=True,
            log_requests_level=level,
        ) as eng:
            out = eng.generate("Hello world", {"max_new_tokens": 3, "temperature": 0.5})
    lines = [r.getMessage() for r in caplog.records if r.name == "radixserve.requests"]
    received = [m for m in lines if m.startswith("Receive:")]
    finished = [m for m in lines if m.startswith("Finish:")]
    assert len(received) == 1 and len(finished) == 1, lines
    assert "completion_tokens=3" in finished[0] and "'type': 'length'" in finished[0]
    assert ("temperature" in received[0]) == (level >= 1)
    assert ("Hello world" in received[0]) == (level >= 2)
    assert (repr(out["text"]) in finished[0]) == (level >= 2)


def test_request_logger_cuts_long_text_at_level_2() -> None:
    from radixserve.managers.request_logger import MAX_PARTIAL_CHARS, RequestLogger

    text = "x" * (MAX_PARTIAL_CHARS + 10)
    assert RequestLogger(True, 3)._cut(text) == text
    cut = RequestLogger(True, 2)._cut(text)
    assert cut.startswith("x" * MAX_PARTIAL_CHARS) and cut.endswith("(10 more characters)")
    assert RequestLogger(True, 2)._cut([1, 2]) == [1, 2]


def test_no_logs_keeps_a_request_out_of_the_request_log(caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's no_logs (zero data retention): nothing of that request is logged, even at level 3."""
    import asyncio
    import logging

    from radixserve.managers.generate_request import GenerateReqInput
    from radixserve.managers.req_state import ReqState
    from radixserve.managers.request_logger import RequestLogger

    request_log = RequestLogger(True, 3)
    with caplog.at_level(logging.INFO, logger="radixserve.requests"):
        for rid, no_logs in (("hidden", True), ("shown", False)):
            item = GenerateReqInput(text="secret", rid=rid, no_logs=no_logs).expand()[0]
            state = ReqState(item, [1, 2], asyncio.Event())
            request_log.log_received(state)
            request_log.log_finished(state)
    lines = [r.getMessage() for r in caplog.records if r.name == "radixserve.requests"]
    assert len(lines) == 2 and all("shown" in m for m in lines) and not any("hidden" in m for m in lines)
    assert "secret" in lines[0]  # level 3 logs the prompt of a request that allows it
