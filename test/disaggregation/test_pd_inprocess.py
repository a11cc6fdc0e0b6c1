"""Prefill/decode disaggregation with both schedulers in this process (radixserve.testing.pd_pair):
greedy parity with one colocated scheduler, the radix cache on the prefill side, fake backend,
aborts, back-pressure and every failure, each ending with both pools back to full."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable

import pytest
import torch

from radixserve.disaggregation.utils import FAKE_BOOTSTRAP_HOST
from radixserve.managers.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.testing.inprocess import InProcessScheduler
from radixserve.testing.pd_pair import PDPair
from radixserve.utils.network import get_free_port

POOL = 8192


def prompts(seed: int, lengths: list[int], vocab: int = 250) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def colocated(model: str, reqs: list[tuple[str, list[int], dict]], **args) -> dict[str, list[int]]:
    ref = InProcessScheduler(model, disable_overlap_schedule=True, max_total_tokens=POOL, **args)
    try:
        for rid, ids, params in reqs:
            ref.submit(rid, ids, **params)
        return {rid: r.output_ids for rid, r in ref.run_until_idle().items()}
    finally:
        ref.close()


def finish(pair: PDPair, rid: str) -> dict:
    return pair.decode.results[rid].finish_reason or {}


def prefill_finish(pair: PDPair, rid: str) -> dict:
    return pair.prefill.results[rid].finish_reason or {}


def step_until(step: Callable[[], None], done: Callable[[], bool], timeout_s: float) -> None:
    """Call `step` until `done()`; fail after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline
        step()


def transferring(pair: PDPair) -> bool:
    """The decode side has bootstrapped and allocated pages: it waits for the KV."""
    return bool(pair.decode.scheduler.hooks.transfer_queue.queue)


def has_finished(side: InProcessScheduler, rid: str) -> bool:
    return rid in side.results and side.results[rid].finish_reason is not None


def assert_clean(pair: PDPair) -> None:
    assert pair.idle()
    assert pair.check_memory_leak() is None
    for side in (pair.prefill, pair.decode):
        s = side.scheduler
        assert s.mem.available_size() + s.mem.evictable_size() == s.mem.total_tokens
    assert not pair.prefill.scheduler.hooks.senders
    assert not pair.decode.scheduler.hooks.receivers


@pytest.fixture
def make_pair(tiny_llama_path):
    made: list[PDPair] = []

    def make(**kw) -> PDPair:
        kw.setdefault("max_total_tokens", POOL)
        pair = PDPair(tiny_llama_path, **kw)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_parity_tcp_with_radix_hit_and_chunks(tiny_llama_path, make_pair, page_size):
    shared = prompts(1, [70])[0]
    tails = prompts(2, [3, 30, 200, 9, 1])
    reqs = [(f"r{i}", shared + t, {"max_new_tokens": 24}) for i, t in enumerate(tails)]
    reqs.append(("long", prompts(3, [300])[0], {"max_new_tokens": 8}))  # chunked on both sides
    args = {"page_size": page_size, "chunked_prefill_size": 128}
    want = colocated(tiny_llama_path, reqs, **args)
    pair = make_pair(**args)
    # The first request warms the prefill side's radix tree; the rest hit the shared prefix.
    pair.submit(*reqs[0][:2], room=1000, **reqs[0][2])
    pair.run_until_idle()
    for i, (rid, ids, params) in enumerate(reqs[1:]):
        pair.submit(rid, ids, room=1001 + i, **params)
    got = {rid: r.output_ids for rid, r in pair.run_until_idle().items()}
    assert got == want
    assert pair.prefill.scheduler.output.stats.cache_hit_tokens >= 4 * (70 // page_size) * page_size
    assert all(finish(pair, rid)["type"] in ("length", "stop") for rid, _, _ in reqs)
    state = pair.prefill.scheduler.get_internal_state().internal_state
    assert state["kv_transfers"] == len(reqs) and state["kv_transfer_bytes"] > 0
    assert_clean(pair)


# make test-all only (docs/testing.md): test_greedy_parity_tcp_with_radix_hit_and_chunks checks the
# same parity with the colocated scheduler on the tiny model (page sizes 1 and 16, radix hits, chunks).
@pytest.mark.slow
def test_greedy_parity_builtin_model(builtin_model_path):
    tok_reqs = [
        (
            "chat",
            [
                1,
                9690,
                198,
                2683,
                359,
                253,
                5356,
                5646,
                11173,
                3365,
                3511,
                308,
                34519,
                28,
                7018,
                411,
                407,
                19712,
                8182,
                2,
                198,
                1,
                4093,
                198,
                1780,
                314,
                260,
                3575,
                282,
                4649,
                47,
                2,
                198,
                1,
                520,
                9531,
                198,
            ],
            {"max_new_tokens": 16},
        ),
        ("plain", list(range(100, 160)), {"max_new_tokens": 8}),
    ]
    want = colocated(builtin_model_path, tok_reqs)
    pair = PDPair(builtin_model_path, max_total_tokens=4096)
    try:
        for i, (rid, ids, params) in enumerate(tok_reqs):
            pair.submit(rid, ids, room=900 + i, **params)
        got = {rid: r.output_ids for rid, r in pair.run_until_idle(timeout_s=300).items()}
        assert got == want
        assert_clean(pair)
    finally:
        pair.close()


def test_first_token_logprob_travels_with_the_kv(tiny_llama_path, make_pair):
    ids = prompts(4, [20])[0]
    ref = InProcessScheduler(tiny_llama_path, disable_overlap_schedule=True, max_total_tokens=POOL)

    def logprobs(sent: list) -> list[float]:
        out: list[float] = []
        for msg in sent:
            if isinstance(msg, BatchTokenIDOut) and msg.output_token_logprobs_val:
                out.extend(msg.output_token_logprobs_val[0])
        return out

    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    sp.normalize()
    ref.scheduler.process_input_requests([TokenizedGenerateReqInput("a", "", ids, sp, return_logprob=True)])
    ref.run_until_idle()
    want = logprobs(ref.sent)
    ref.close()
    pair = make_pair()
    pair.submit("a", ids, room=5, max_new_tokens=6, return_logprob=True)
    pair.run_until_idle()
    got = logprobs(pair.decode.sent)
    assert len(got) == 6 == len(want)
    assert got == pytest.approx(want, abs=1e-4)


def test_fake_backend_moves_nothing_and_frees_everything(make_pair):
    pair = make_pair(backend="fake")
    for i, ids in enumerate(prompts(5, [10, 50, 7])):
        msg = pair.message(f"f{i}", ids, None, max_new_tokens=5)
        pair.prefill.scheduler.process_input_requests([msg])
        pair.decode.scheduler.process_input_requests([msg])
    pair.run_until_idle()
    for i in range(3):
        assert finish(pair, f"f{i}")["type"] == "length" and len(pair.decode.results[f"f{i}"].output_ids) == 5
        assert prefill_finish(pair, f"f{i}")["type"] in ("length", "stop")
    assert pair.prefill.scheduler.hooks.manager.stats.num_transfers == 0
    assert_clean(pair)


def test_fake_bootstrap_host_probe_on_a_tcp_pair(make_pair):
    """SGLang's health probe: bootstrap_host 2.2.2.2 needs no peer on either side."""
    pair = make_pair()
    msg = pair.message("probe", [5], 0, max_new_tokens=1)
    msg = dataclasses.replace(
        msg, routing=dataclasses.replace(msg.routing, bootstrap_host=FAKE_BOOTSTRAP_HOST)
    )
    pair.prefill.scheduler.process_input_requests([msg])
    pair.decode.scheduler.process_input_requests([msg])
    pair.run_until_idle(timeout_s=30)
    assert finish(pair, "probe")["type"] == "length"
    assert prefill_finish(pair, "probe")["type"] in ("length", "stop")
    assert_clean(pair)


def test_requests_without_a_room_are_refused(make_pair):
    pair = make_pair()
    msg = pair.message("x", [5, 6], None, max_new_tokens=3)
    pair.prefill.scheduler.process_input_requests([msg])
    pair.decode.scheduler.process_input_requests([msg])
    pair.run_until_idle(timeout_s=10)
    for side in (pair.prefill, pair.decode):
        reason = side.results["x"].finish_reason
        assert (
            reason["type"] == "abort"
            and reason["status_code"] == 400
            and "bootstrap_room" in reason["message"]
        )
    assert_clean(pair)


def test_decode_back_pressure_then_all_finish(tiny_llama_path, make_pair):
    """A decode pool with room for a few requests at a time: the rest wait in the prealloc queue
    (bootstrapped, nothing allocated) and all finish with the colocated output."""
    reqs = [(f"b{i}", ids, {"max_new_tokens": 40}) for i, ids in enumerate(prompts(6, [150] * 8))]
    want = colocated(tiny_llama_path, reqs)
    pair = make_pair(decode_args={"max_total_tokens": 600})
    for i, (rid, ids, params) in enumerate(reqs):
        pair.submit(rid, ids, room=2000 + i, **params)
    max_prealloc = 0
    deadline = time.monotonic() + 120
    while not pair.idle():
        assert time.monotonic() < deadline
        pair.step()
        max_prealloc = max(max_prealloc, len(pair.decode.scheduler.hooks.prealloc_queue.queue))
    assert max_prealloc >= 4  # most waited for pages
    got = {rid: r.output_ids for rid, r in pair.decode.results.items()}
    assert got == want
    assert_clean(pair)


def test_hundred_mixed_requests_with_aborts_then_both_pools_full(make_pair):
    rng = random.Random(7)
    pair = make_pair(decode_args={"max_total_tokens": 3000}, chunked_prefill_size=64)
    rids = []
    for i in range(100):
        ids = prompts(100 + i, [rng.choice([1, 5, 40, 130])])[0]
        pair.submit(f"m{i}", ids, room=3000 + i, max_new_tokens=rng.choice([1, 4, 30]))
        rids.append(f"m{i}")
    aborts = {
        rid: (rng.choice(["prefill", "decode", "both"]), rng.randrange(0, 40)) for rid in rng.sample(rids, 30)
    }
    step = 0
    deadline = time.monotonic() + 240
    while not pair.idle():
        assert time.monotonic() < deadline
        for rid, (side, at) in aborts.items():
            if at == step:
                pair.abort(rid, side)
        pair.step()
        step += 1
    pair.run_until_idle()
    for rid in rids:
        reason = finish(pair, rid)
        assert reason["type"] in ("length", "stop", "abort"), (rid, reason)
        if reason["type"] == "abort":
            assert rid in aborts and "bort" in reason["message"], (rid, reason)
    assert_clean(pair)


# ------------------------------------------------------------------------------------- failures
def test_bootstrap_timeout_on_both_sides(make_pair):
    pair = make_pair(disaggregation_bootstrap_timeout=0.5)
    ids = prompts(8, [12])[0]
    # Only the prefill side gets request "p": no decode ever bootstraps its room.
    pair.prefill.scheduler.process_input_requests([pair.message("p", ids, 11, max_new_tokens=4)])
    # Only the decode side gets "d": its KV never comes.
    pair.decode.scheduler.process_input_requests([pair.message("d", ids, 12, max_new_tokens=4)])
    pair.run_until_idle(timeout_s=30)
    for reason in (prefill_finish(pair, "p"), finish(pair, "d")):
        assert reason["type"] == "abort" and reason["status_code"] == 503
        assert "bootstrap timeout (0.5 s)" in reason["message"]
    assert_clean(pair)


def test_unreachable_bootstrap_server_times_out(make_pair):
    pair = make_pair(disaggregation_bootstrap_timeout=0.5)
    msg = pair.message("u", [4, 5, 6], 13, max_new_tokens=4)
    msg = dataclasses.replace(msg, routing=dataclasses.replace(msg.routing, bootstrap_port=get_free_port()))
    pair.decode.scheduler.process_input_requests([msg])
    pair.run_until_idle(timeout_s=30)
    reason = finish(pair, "u")
    assert reason["type"] == "abort" and "did not answer" in reason["message"]
    assert_clean(pair)


def test_mismatched_page_size_fails_on_both_sides(make_pair):
    pair = make_pair(prefill_args={"page_size": 1}, decode_args={"page_size": 16})
    pair.submit("mm", prompts(9, [20])[0], room=14, max_new_tokens=4)
    pair.run_until_idle(timeout_s=30)
    reason = finish(pair, "mm")
    assert reason["type"] == "abort" and reason["status_code"] == 500
    assert "page_size" in reason["message"] and "must match" in reason["message"]
    assert_clean(pair)


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("stage", ["bootstrap", "transfer", "decoding"])
def test_abort_at_either_side_at_any_stage(make_pair, side, stage):
    pair = make_pair()
    ids = prompts(10, [60])[0]
    pair.submit("a", ids, room=15, max_new_tokens=60, ignore_eos=True)
    if stage == "transfer":  # decode has bootstrapped and allocated; prefill not run yet
        step_until(pair.decode.step, lambda: transferring(pair), 10)
    elif stage == "decoding":
        live = pair.decode.scheduler.state.live
        step_until(pair.step, lambda: "a" in live and len(live["a"].output_ids) >= 3, 10)
    pair.abort("a", side)
    pair.run_until_idle(timeout_s=30)
    reason = finish(pair, "a")
    if stage == "decoding" and side == "prefill":
        assert reason["type"] == "length"  # prefill's part was over: decode finishes normally
    else:
        assert reason["type"] == "abort" and "bort" in reason["message"], reason
    assert_clean(pair)


def test_prefill_dies_mid_transfer(make_pair):
    pair = make_pair()
    pair.submit("k", prompts(11, [40])[0], room=16, max_new_tokens=8)
    step_until(pair.decode.step, lambda: transferring(pair), 10)  # pages allocated, KV expected
    pair.prefill.scheduler.hooks.close()  # its sockets close as a killed process's do
    step_until(pair.decode.step, lambda: has_finished(pair.decode, "k"), 20)
    reason = finish(pair, "k")
    assert (
        reason["type"] == "abort"
        and "prefill server" in reason["message"]
        and "disconnected" in reason["message"]
    )
    assert pair.decode.check_memory_leak() is None


def test_decode_dies_before_its_kv_is_acknowledged(make_pair):
    pair = make_pair()
    pair.submit("k", prompts(12, [40])[0], room=17, max_new_tokens=8)
    step_until(pair.decode.step, lambda: transferring(pair), 10)
    time.sleep(0.2)  # the init reaches the prefill side
    pair.decode.scheduler.hooks.close()
    step_until(pair.prefill.step, lambda: has_finished(pair.prefill, "k"), 20)
    reason = prefill_finish(pair, "k")
    assert (
        reason["type"] == "abort"
        and "decode server" in reason["message"]
        and "disconnected" in reason["message"]
    )
    assert pair.prefill.check_memory_leak() is None


def test_no_valid_first_token_fails_the_request_on_both_sides(make_pair, monkeypatch):
    """The prefill side's sampler finds no valid token (non-finite logits): the request fails with
    the colocated server's 500 on both sides, instead of the placeholder id travelling to decode."""
    pair = make_pair()
    sched = pair.prefill.scheduler
    run_batch = sched.run_batch

    def invalid_rows(batch):  # noqa: ANN001, ANN202 - wraps Scheduler.run_batch
        result = run_batch(batch)
        result.invalid_rows = torch.ones(batch.batch_size(), dtype=torch.bool)
        return result

    monkeypatch.setattr(sched, "run_batch", invalid_rows)
    pair.submit("nan", prompts(12, [20])[0], room=17, max_new_tokens=8)
    pair.run_until_idle(timeout_s=30)
    for reason in (prefill_finish(pair, "nan"), finish(pair, "nan")):
        assert reason["type"] == "abort", reason
    assert prefill_finish(pair, "nan")["status_code"] == 500
    assert "no valid next token" in finish(pair, "nan")["message"]
    assert not pair.decode.results["nan"].output_ids
    assert sched.num_inflight_batches == 0
    assert_clean(pair)


def test_one_pass_admits_up_to_the_running_cap(make_pair):
    """Requests admitted earlier in one prealloc pass count once against --max-running-requests
    (they are already in the transfer queue), so four waiting requests under a cap of four all
    get pages in the same pass."""
    pair = make_pair(backend="fake", decode_args={"max_running_requests": 4})
    decode = pair.decode.scheduler
    for i, ids in enumerate(prompts(8, [20] * 5)):
        decode.process_input_requests([pair.message(f"c{i}", ids, None, max_new_tokens=3)])
    admitted = decode.hooks.prealloc_queue.pop_preallocated()
    assert [r.rid for r in admitted] == ["c0", "c1", "c2", "c3"]
    assert [r.rid for r in decode.hooks.prealloc_queue.queue] == ["c4"]


def test_generated_token_counts_match_a_colocated_server(tiny_llama_path, make_pair):
    """Each side counts the tokens it emits as a colocated server counts them: the decode side
    the whole answer (the first token arrives with the KV), the prefill side its one token."""
    reqs = [
        ("a", prompts(11, [20])[0], {"max_new_tokens": 8}),
        ("b", prompts(12, [9])[0], {"max_new_tokens": 5}),
    ]

    def colocated_count(max_new_tokens: int | None) -> int:
        ref = InProcessScheduler(tiny_llama_path, disable_overlap_schedule=True, max_total_tokens=POOL)
        try:
            for rid, ids, params in reqs:
                ref.submit(
                    rid, ids, **{**params, **({"max_new_tokens": max_new_tokens} if max_new_tokens else {})}
                )
            ref.run_until_idle()
            return ref.scheduler.output.stats.num_generated_tokens
        finally:
            ref.close()

    pair = make_pair()
    for i, (rid, ids, params) in enumerate(reqs):
        pair.submit(rid, ids, room=4000 + i, **params)
    pair.run_until_idle()
    assert pair.decode.scheduler.output.stats.num_generated_tokens == colocated_count(None)
    assert pair.prefill.scheduler.output.stats.num_generated_tokens == colocated_count(1) == len(reqs)
    assert_clean(pair)
