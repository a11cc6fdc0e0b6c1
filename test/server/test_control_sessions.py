"""Sessions through the Engine on the tiny random Llama: a continued turn is built from the
history (input + output of the request it continues) and reuses its KV (cached_tokens), greedy
outputs equal HF's on the whole conversation, `replace` branches, `offset` and
`drop_previous_output` cut the history, and every refusal is an abort with a message, not a hang."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from radixserve import Engine
from radixserve.testing.tiny_models import hf_greedy

pytestmark = pytest.mark.timeout(300)

G = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
TURNS = [[5, 17, 99, 120, 33, 7, 250], [44, 45, 46], [47, 48, 49, 50]]


@pytest.fixture(scope="module")
def hf(tiny_llama_path: str) -> Any:  # noqa: ANN401
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def _gen(engine: Engine, ids: list[int], req_id: str, **session: Any) -> dict:
    """Generate `ids` as request `req_id`; `session` is its session_params (id, rid, ...)."""
    return engine.generate(input_ids=ids, sampling_params=G, rid=req_id, session_params=session or None)


def test_three_turns_reuse_the_history(tiny_engine: Engine, hf: Any) -> None:
    assert tiny_engine.flush_cache()  # the shared engine may hold these prompts from other tests
    sid = tiny_engine.open_session(4096)
    history: list[int] = []
    parent = None
    for turn, ids in enumerate(TURNS):
        rid = f"{sid}-turn{turn}"
        out = _gen(tiny_engine, ids, rid, id=sid, rid=parent)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(history) + len(ids)
        # Everything before the new input has KV in the cache except the previous turn's last
        # sampled token (it was never fed back): the whole history minus one token is a hit.
        assert meta["cached_tokens"] == max(len(history) - 1, 0)
        assert out["output_ids"] == hf_greedy(hf, history + ids, 6)[0]
        history += ids + out["output_ids"]
        parent = rid
    tiny_engine.close_session(sid)


def test_replace_offset_and_drop_previous_output(tiny_engine: Engine, hf: Any) -> None:
    sid = tiny_engine.open_session(4096, session_id="branchy")
    assert sid == "branchy"
    root = _gen(tiny_engine, TURNS[0], "b-root", id=sid)
    first = _gen(tiny_engine, TURNS[1], "b-1", id=sid, rid="b-root")
    base = TURNS[0] + root["output_ids"]
    # A new branch at the root replaces the first continuation (and its descendants).
    branch = _gen(tiny_engine, TURNS[2], "b-2", id=sid, rid="b-root", replace=True)
    assert branch["output_ids"] == hf_greedy(hf, base + TURNS[2], 6)[0]
    gone = _gen(tiny_engine, [9], "b-3", id=sid, rid="b-1")  # the replaced branch is forgotten
    assert gone["meta_info"]["finish_reason"]["type"] == "abort"
    assert "b-1 is not in session" in gone["meta_info"]["finish_reason"]["message"]
    assert first["meta_info"]["finish_reason"]["type"] == "length"
    # drop_previous_output: continue from the prompt alone; offset: keep the first 3 tokens.
    dropped = _gen(tiny_engine, TURNS[1], "b-4", id=sid, rid="b-root", drop_previous_output=True)
    assert dropped["meta_info"]["prompt_tokens"] == len(TURNS[0]) + len(TURNS[1])
    assert dropped["output_ids"] == hf_greedy(hf, TURNS[0] + TURNS[1], 6)[0]
    cut = _gen(tiny_engine, TURNS[1], "b-5", id=sid, rid="b-root", offset=3)
    assert cut["output_ids"] == hf_greedy(hf, base[:3] + TURNS[1], 6)[0]
    tiny_engine.close_session(sid)


def test_session_refusals(tiny_engine: Engine) -> None:
    sessions_before = tiny_engine.get_internal_state()["num_sessions"]
    sid = tiny_engine.open_session(100)
    with pytest.raises(ValueError, match="already exist"):
        tiny_engine.open_session(100, session_id=sid)
    unknown = _gen(tiny_engine, TURNS[0], "r-1", id="no-such-session")
    assert unknown["meta_info"]["finish_reason"]["message"] == (
        "Invalid request: session id no-such-session does not exist"
    )
    assert unknown["meta_info"]["finish_reason"]["status_code"] == 400
    missing_rid = _gen(tiny_engine, TURNS[0], "r-2", id=sid, rid="never-ran")
    assert missing_rid["meta_info"]["finish_reason"]["type"] == "abort"
    with pytest.raises(ValueError, match="Unknown session_params"):
        tiny_engine.generate(input_ids=TURNS[0], sampling_params=G, session_params={"id": sid, "turn": 2})
    with pytest.raises(ValueError, match="offset must be >= 0"):
        tiny_engine.generate(input_ids=TURNS[0], sampling_params=G, session_params={"id": sid, "offset": -1})

    # Continuing a request that has not finished is refused; the running one is not disturbed.
    results: dict[str, dict] = {}
    long = dict(G, max_new_tokens=400)
    runner = threading.Thread(
        target=lambda: results.update(
            long=tiny_engine.generate(
                input_ids=TURNS[0], sampling_params=long, rid="r-long", session_params={"id": sid}
            )
        )
    )
    tiny_engine.slow_down(0.02)  # r-long surely still runs when r-early arrives, however loaded
    runner.start()
    _wait(lambda: tiny_engine.get_internal_state()["num_running_reqs"] > 0)
    early = _gen(tiny_engine, TURNS[1], "r-early", id=sid, rid="r-long")
    tiny_engine.slow_down(None)
    assert "has not finished" in early["meta_info"]["finish_reason"]["message"]
    # Closing the session while r-long runs: closed once r-long ends.
    tiny_engine.close_session(sid)
    runner.join(120)
    assert results["long"]["meta_info"]["finish_reason"]["type"] == "length"
    _wait(lambda: tiny_engine.get_internal_state()["num_sessions"] == sessions_before)
    with pytest.raises(ValueError, match="does not exist"):
        tiny_engine.close_session(sid)


def _wait(check: Any, timeout: float = 30) -> None:  # noqa: ANN401
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)
