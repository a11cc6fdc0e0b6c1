"""Memory release / resume and pause / continue through the Engine on the tiny random Llama.

Release frees the KV pool and the weights (the scheduler's address space shrinks by about the
pool's size: a CPU pool is mapped lazily, mem_cache/cpu_alloc.py, so RSS counts only the pages
requests wrote, while the mapping itself is the pool's whole size), a
generate request meanwhile is refused with 503, and resume gives the same greedy output as
before. Pause in each of SGLang's modes holds new requests until continue; `in_place` and
`retract` requests then finish with exactly the tokens an uninterrupted run gives."""

from __future__ import annotations

import threading
import time
from typing import Any

import psutil
import pytest
from real_helpers import engine_leak_check

from radixserve import Engine

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 99, 120, 33, 7, 250, 61]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True}
# KV bytes per token of the tiny Llama: 2 layers x 2 KV heads x 16 dims x 4 bytes x (K + V) = 512.
BIG_POOL_TOKENS = 400_000  # ~195 MiB of KV


def _scheduler_vms(engine: Engine) -> int:
    pid = engine.tokenizer_manager.ranks[0]["pid"]
    return psutil.Process(pid).memory_info().vms


def test_release_then_resume(tiny_llama_path: str) -> None:
    with Engine(model_path=tiny_llama_path, max_total_tokens=BIG_POOL_TOKENS, log_level="warning") as engine:
        before = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        vms_before = _scheduler_vms(engine)
        ok, message = engine.release_memory_occupation(["kv_cache"])
        assert ok, message
        vms_released = _scheduler_vms(engine)
        assert vms_before - vms_released > 150 * 2**20, (vms_before, vms_released)  # the pool's ~195 MiB
        assert engine.get_internal_state()["memory_released"] == ["kv_cache"]

        ok, message = engine.release_memory_occupation(["weights"])
        assert ok, message
        refused = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["meta_info"]
        assert refused["finish_reason"]["status_code"] == 503
        assert "/resume_memory_occupation" in refused["finish_reason"]["message"]
        with pytest.raises(ValueError, match="released"):
            engine.get_weights_by_name("model.norm.weight")
        assert engine.update_weights_from_disk(tiny_llama_path)[0] is False

        assert engine.release_memory_occupation(["gpu_cache"]) == (
            False,
            "Unknown memory tag(s) ['gpu_cache']: use ['kv_cache', 'weights'] or null for both.",
        )
        ok, message = engine.resume_memory_occupation()
        assert ok and tiny_llama_path in message, message
        assert _scheduler_vms(engine) - vms_released > 150 * 2**20
        after = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["cached_tokens"] == 0  # the cache went with the KV pool
        assert engine_leak_check(engine) is None


def _start(engine: Engine, results: dict[str, Any], key: str, params: dict = LONG) -> threading.Thread:
    def run() -> None:
        results[key] = engine.generate(input_ids=PROMPT, sampling_params=params)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait(check: Any, timeout: float = 30) -> None:  # noqa: ANN401
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_and_continue_keep_the_requests(tiny_engine: Engine, mode: str) -> None:
    reference = tiny_engine.generate(input_ids=PROMPT, sampling_params=LONG)["output_ids"]
    state = tiny_engine.get_internal_state
    results: dict[str, Any] = {}
    running = _start(tiny_engine, results, "running")
    _wait(lambda: state()["num_running_reqs"] == 1)
    assert tiny_engine.pause_generation(mode) == (True, f"Generation paused ({mode}).")
    held = _start(tiny_engine, results, "held", GREEDY)
    time.sleep(0.5)
    s = state()
    assert s["paused"] == mode and running.is_alive() and held.is_alive()
    if mode == "retract":
        _wait(lambda: state()["num_waiting_reqs"] == 1 and state()["num_running_reqs"] == 0)
    else:
        assert s["num_running_reqs"] == 1
    assert tiny_engine.continue_generation()[0]
    running.join(60)
    held.join(60)
    assert results["running"]["output_ids"] == reference
    assert results["held"]["meta_info"]["finish_reason"]["type"] == "length"
    assert state()["paused"] is None


def test_pause_abort_mode_aborts_and_holds(tiny_engine: Engine) -> None:
    results: dict[str, Any] = {}
    running = _start(tiny_engine, results, "running")
    _wait(lambda: tiny_engine.get_internal_state()["num_running_reqs"] == 1)
    assert tiny_engine.pause_generation("abort")[0]
    running.join(30)
    assert results["running"]["meta_info"]["finish_reason"]["type"] == "abort"
    held = _start(tiny_engine, results, "held", GREEDY)
    time.sleep(0.3)
    assert held.is_alive()
    assert tiny_engine.continue_generation()[0]
    held.join(30)
    assert results["held"]["meta_info"]["finish_reason"]["type"] == "length"
    assert tiny_engine.pause_generation("sideways") == (
        False,
        "mode must be one of abort, retract, in_place, got 'sideways'.",
    )
    assert tiny_engine.continue_generation() == (True, "Generation was not paused.")
