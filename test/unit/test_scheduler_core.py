"""Scheduler end to end over the real-pool FakeWorker: outputs, chunking, paging, caching, retraction,
overlap, finish conditions, logprobs."""

from __future__ import annotations

import logging

import pytest
from fake_worker import FakeWorker, random_workload, reference_output

from radixserve.managers.io_struct import BatchTokenIDOut, FlushCacheReqInput, GetInternalStateReq


def run_workload(make_harness, workload, worker=None, **args):
    h = make_harness(worker=worker, **args)
    for rid, ids, max_new in workload:
        h.submit(rid, ids, max_new)
    h.run_until_idle()
    assert h.worker.unwritten_reads == 0
    return h


def test_outputs_match_reference(make_harness):
    workload = random_workload(1, 12)
    h = run_workload(make_harness, workload)
    for rid, ids, max_new in workload:
        assert h.outputs[rid] == reference_output(ids, max_new)
        assert h.finished[rid] == {"type": "length", "length": max_new}


@pytest.mark.parametrize(
    "args",
    [
        {"chunked_prefill_size": 16},
        {"chunked_prefill_size": 7, "max_prefill_tokens": 20},
        {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
        {"disable_radix_cache": True},
        {"disable_radix_cache": True, "chunked_prefill_size": 8},
        {"schedule_policy": "dfs-weight"},
        {"schedule_policy": "lof", "max_running_requests": 3},
    ],
)
def test_variants_match_reference(make_harness, args):
    workload = random_workload(2, 16)
    h = run_workload(make_harness, workload, **args)
    for rid, ids, max_new in workload:
        assert h.outputs[rid] == reference_output(ids, max_new), rid
    # The variant ran as claimed: mixed chunk did mix decodes into chunk forwards.
    assert ("MIXED" in h.worker.forward_modes) == bool(args.get("enable_mixed_chunk"))


@pytest.mark.parametrize("chunk", [None, 12])
def test_page_size_4(make_harness, chunk):
    workload = random_workload(3, 12)
    h = run_workload(
        make_harness, workload, worker=FakeWorker(page_size=4), page_size=4, chunked_prefill_size=chunk
    )
    for rid, ids, max_new in workload:
        assert h.outputs[rid] == reference_output(ids, max_new), rid


def test_chunk_boundaries_and_resumption(make_harness):
    prompt = list(range(100, 150))  # 50 tokens, chunks of 16: 16, 16, 16, 2
    h = make_harness(chunked_prefill_size=16)
    h.submit("long", prompt, 5, stream=True)
    h.step()
    st = h.scheduler.state
    assert st.chunked_req is not None and st.chunked_req.extend_input_len == 16
    assert "long" not in h.outputs  # a middle chunk streams nothing
    h.step()
    h.step()
    assert st.chunked_req is not None and len(st.chunked_req.prefix_indices) == 32
    h.run_until_idle()
    assert h.outputs["long"] == reference_output(prompt, 5)
    extend_modes = [m for m in h.worker.forward_modes if m == "EXTEND"]
    assert len(extend_modes) == 4


def test_prefix_cache_hit(make_harness):
    h = make_harness()
    shared = list(range(1, 41))
    h.submit("a", shared + [500, 501], 4)
    h.run_until_idle()
    h.submit("b", shared + [600], 4)
    h.run_until_idle()
    msg = [m for m in h.messages(BatchTokenIDOut) if "b" in m.rids][-1]
    assert msg.cached_tokens[msg.rids.index("b")] == 40
    assert h.outputs["b"] == reference_output(shared + [600], 4)
    state = h.scheduler.get_internal_state().internal_state
    assert state["cache_hit_tokens"] >= 40


def test_sibling_of_a_chunked_prompt_reuses_its_whole_prefix(make_harness):
    """Chunks of 64: "a" runs its 104-token prompt in two chunks. "b" shares a's first 96 tokens;
    it waits while a's second chunk computes the rest of that prefix instead of computing it again
    beside it, then reuses all 96 tokens."""
    shared = list(range(1, 97))
    h = make_harness(chunked_prefill_size=64)
    h.submit("a", shared + [500] * 8, 4)
    h.submit("b", shared + [600] * 8, 4)
    h.run_until_idle()
    state = h.scheduler.get_internal_state().internal_state
    assert state["cache_hit_tokens"] == 96
    msg = [m for m in h.messages(BatchTokenIDOut) if "b" in m.rids][-1]
    assert msg.cached_tokens[msg.rids.index("b")] == 96
    assert h.outputs["b"] == reference_output(shared + [600] * 8, 4)


def test_load_leaves_out_requests_that_finished_in_the_last_step(make_harness):
    h = make_harness()
    h.submit("short", [1, 2, 3], 2)
    h.submit("long", [4, 5, 6], 20)
    while "short" not in h.finished:
        h.step()
    # "short" finished in this step and leaves the running batch in the next one: not load.
    assert any(r.rid == "short" for r in h.scheduler.state.running_batch.reqs)
    assert h.scheduler.get_load().num_reqs == 1
    h.run_until_idle()
    assert h.scheduler.get_load().num_reqs == 0


def test_flush_right_after_the_last_answer_succeeds(make_harness):
    """A client that flushes as soon as its last answer arrives must not be refused: the request
    that finished in the last step is no work (its KV is back), though it leaves the running batch
    only in the next step. On a busy machine the flush can reach the scheduler before that step.
    (The overlap loop still refuses it while the batch launched after the answer is in flight.)"""
    h = make_harness()
    h.submit("only", [1, 2, 3], 3)
    while "only" not in h.finished:
        h.step()
    h.step([FlushCacheReqInput()])
    flushed = [m for m in h.sent if not isinstance(m, BatchTokenIDOut)][-1]
    assert flushed.success is True, flushed.message
    assert h.scheduler.is_idle()


def test_load_names_the_replica(make_harness):
    """A data-parallel replica's scheduler stamps its own dp_rank on its load (SchedulerIO sends it
    to the controller as it is)."""
    h = make_harness()
    h.scheduler.dp_rank = 2  # what build_scheduler passes for replica 2
    assert h.scheduler.get_load().dp_rank == 2


def long_output_workload(n=16):
    return [(f"L{i}", [(i * 37 + j) % 997 for j in range(20)], 60) for i in range(n)]


def test_retraction_tiny_pool_same_outputs(make_harness, caplog):
    workload = long_output_workload()
    big = run_workload(make_harness, workload)
    tiny_worker = FakeWorker(max_total_num_tokens=400)
    with caplog.at_level(logging.WARNING):
        tiny = run_workload(make_harness, workload, worker=tiny_worker)
    assert "Retract requests" in caplog.text
    assert tiny.outputs == big.outputs
    assert all(r["type"] == "length" for r in tiny.finished.values())


def test_retraction_overlap_tiny_pool(make_harness):
    workload = long_output_workload(20)
    big = run_workload(make_harness, workload)
    tiny = run_workload(
        make_harness, workload, worker=FakeWorker(max_total_num_tokens=360), disable_overlap_schedule=False
    )
    assert tiny.outputs == big.outputs


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"chunked_prefill_size": 24},
        {"chunked_prefill_size": 24, "enable_mixed_chunk": True, "page_size": 4},
        {"disable_radix_cache": True},
    ],
)
def test_overlap_equals_normal(make_harness, args):
    workload = random_workload(6, 60)
    page = args.get("page_size", 1)
    normal = run_workload(
        make_harness, workload, worker=FakeWorker(page_size=page, max_total_num_tokens=1600), **args
    )
    overlap_worker = FakeWorker(page_size=page, max_total_num_tokens=1600)
    overlap = run_workload(
        make_harness, workload, worker=overlap_worker, disable_overlap_schedule=False, **args
    )
    assert overlap.outputs == normal.outputs
    assert overlap.finished == normal.finished
    assert len(overlap_worker.thread_ids) == 1 and overlap_worker.thread_ids != normal.worker.thread_ids
    mixed = bool(args.get("enable_mixed_chunk"))
    assert ("MIXED" in normal.worker.forward_modes) == mixed
    assert ("MIXED" in overlap_worker.forward_modes) == mixed


def test_eos_stop_token_and_min_new_tokens(make_harness):
    worker = FakeWorker(eos_token_id=5, eos_period=3)
    h = make_harness(worker=worker, eos=(5,))
    prompt = list(range(10, 30))
    h.submit("eos", prompt, 64)
    h.submit("ignore", prompt, 12, ignore_eos=True)
    h.submit("min", prompt, 64, min_new_tokens=10)
    h.run_until_idle()
    assert h.finished["eos"] == {"type": "stop", "matched": 5}
    assert h.outputs["eos"][-1] == 5 and 5 not in h.outputs["eos"][:-1]
    assert h.finished["ignore"]["type"] == "length" and len(h.outputs["ignore"]) == 12
    assert len(h.outputs["min"]) >= 10
    ref = reference_output(prompt, 4)
    h = make_harness()
    h.submit("stop_id", prompt, 64, stop_token_ids=[ref[2]])
    h.run_until_idle()
    assert h.finished["stop_id"] == {"type": "stop", "matched": ref[2]} and len(h.outputs["stop_id"]) == 3


class CharTokenizer:
    """Token t decodes to chr(ord('a') + t % 26)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_string(make_harness):
    prompt = list(range(40, 60))
    text = CharTokenizer().decode(reference_output(prompt, 10))
    h = make_harness(tokenizer=CharTokenizer())
    h.submit("s", prompt, 10, stop=[text[4:6]])
    h.run_until_idle()
    assert h.finished["s"] == {"type": "stop", "matched": text[4:6]}
    assert CharTokenizer().decode(h.outputs["s"]).endswith(text[4:6])


def test_stop_string_completed_before_min_new_tokens_does_not_count(make_harness):
    prompt = list(range(40, 60))
    text = CharTokenizer().decode(reference_output(prompt, 12))  # one character per token
    stop = text[3:5]  # completed by token 5, before min_new_tokens = 6
    h = make_harness(tokenizer=CharTokenizer())
    h.submit("s", prompt, 12, stop=[stop], min_new_tokens=6)
    h.run_until_idle()
    # The first k >= 6 whose k-th token completes the stop string, else the length limit.
    k = next((k for k in range(6, 13) if text[k - 2 : k] == stop), None)
    want = {"type": "stop", "matched": stop} if k else {"type": "length", "length": 12}
    assert h.finished["s"] == want and len(h.outputs["s"]) == (k or 12)


def test_streaming_one_message_per_step(make_harness):
    h = make_harness()
    h.submit("s1", [1, 2, 3], 5, stream=True)
    h.submit("s2", [4, 5, 6], 5, stream=True)
    h.submit("quiet", [7, 8, 9], 5)
    h.step()
    msgs = h.messages(BatchTokenIDOut)
    assert len(msgs) == 1 and msgs[0].rids == ["s1", "s2"]
    assert all(t is not None and t >= 0 for t in msgs[0].queue_times)
    assert all(len(ids) == 1 for ids in msgs[0].output_ids)
    h.run_until_idle()
    quiet = [m for m in h.messages(BatchTokenIDOut) if "quiet" in m.rids]
    assert len(quiet) == 1 and len(quiet[0].output_ids[quiet[0].rids.index("quiet")]) == 5


def test_logprobs(make_harness):
    h = make_harness()
    h.submit("lp", list(range(20)), 4, return_logprob=True, logprob_start_len=5, top_logprobs_num=2)
    h.run_until_idle()
    assert len(h.logprobs["lp"]) == 4
    assert len(h.input_logprobs["lp"]) == 20 - 5 - 1


def test_prompt_logprobs_of_a_re_prefill_are_not_reported_twice():
    """A chunked request preempted after some chunks' logprobs went out (overlap: even before any
    output token) re-prefills from scratch; only positions not yet reported, and only prompt
    positions (a re-prefill after retraction also covers output tokens), may be added."""
    from radixserve.sampling.sampling_params import SamplingParams
    from req_factory import make_req

    prompt = list(range(100, 124))
    req = make_req("r", prompt, SamplingParams(max_new_tokens=4), return_logprob=True, logprob_start_len=0)
    req.append_input_logprobs([-1.0] * 8, 1)  # chunk 1: positions 1..8
    req.append_input_logprobs([-2.0] * 8, 9)  # chunk 2: positions 9..16
    req.append_input_logprobs([-3.0] * 25, 1)  # re-prefill of prompt + 2 output tokens
    assert req.logprobs.input_idx == prompt[1:]
    assert req.logprobs.input_val == [-1.0] * 8 + [-2.0] * 8 + [-3.0] * 7


def test_max_running_requests_counts_the_chunked_request(make_harness):
    h = make_harness(max_running_requests=2, chunked_prefill_size=8)
    h.submit("long", list(range(1, 34)), 20)  # chunks of 8: it holds a row while others arrive
    h.step()
    for i in range(3):
        h.submit(f"s{i}", [300 + 10 * i + j for j in range(2)], 20)
    peak = 0
    for _ in range(12):
        h.step()
        peak = max(peak, len(h.scheduler.state.running_batch.reqs))
    assert peak == 2
    h.run_until_idle()
    assert all(h.finished[r]["type"] == "length" for r in ("long", "s0", "s1", "s2"))


@pytest.mark.parametrize("steps", [1, 4])
def test_mixed_chunk_fits_chunks_and_riding_decodes_in_a_tight_pool(make_harness, steps):
    """With mixed chunk, the running request decodes in every chunk's forward: the next chunk and
    those decodes must both fit the KV actually free (neither was checked: RuntimeError)."""
    worker = FakeWorker(max_total_num_tokens=48, max_context_len=512)
    h = make_harness(worker=worker, chunked_prefill_size=3, enable_mixed_chunk=True)
    h.submit("R", list(range(1, 5)), 20)
    for _ in range(steps):
        h.step()
    h.submit("C", list(range(300, 330)), 1)
    h.run_until_idle()
    assert h.outputs["R"] == reference_output(list(range(1, 5)), 20)
    assert h.outputs["C"] == reference_output(list(range(300, 330)), 1)
    assert h.scheduler.check_memory_leak() is None
    # R decoded inside C's chunk forwards (the situation under test), not only between them.
    assert h.worker.forward_modes.count("MIXED") >= 2, h.worker.forward_modes


def test_mixed_chunk_counts_a_page_per_decode_that_starts_one(make_harness):
    # 16 pages: N (8 pages) is admitted while R decodes, so R's decodes (each starting a page) ride
    # in N's chunk forwards.
    worker = FakeWorker(max_total_num_tokens=16 * 16, max_context_len=512, page_size=16)
    h = make_harness(worker=worker, page_size=16, chunked_prefill_size=64, enable_mixed_chunk=True)
    prompts = {f"R{i}": [(i * 50 + j) % 997 + 1 for j in range(16)] for i in range(3)}
    for rid, prompt in prompts.items():
        h.submit(rid, prompt, 4)  # one full page each: every first decode starts a new page
    h.step()
    prompts["N"] = [(900 + j) % 997 for j in range(120)]
    h.submit("N", prompts["N"], 2)
    h.run_until_idle()
    for rid, prompt in prompts.items():
        assert h.outputs[rid] == reference_output(prompt, 2 if rid == "N" else 4)
    assert h.scheduler.check_memory_leak() is None
    assert "MIXED" in h.worker.forward_modes, h.worker.forward_modes


def test_mixed_chunk_admission_reserves_a_page_per_decode(make_harness, caplog):
    """Admission beside riding decodes reserves a whole page for each decode that starts one: in
    a 6-page pool with R0-R2 on full pages, N must wait. Counting one token per decode admitted N,
    whose prefill then left the decodes 1 page for 3 and forced a retraction."""
    worker = FakeWorker(max_total_num_tokens=16 * 6, max_context_len=512, page_size=16)
    h = make_harness(worker=worker, page_size=16, chunked_prefill_size=64, enable_mixed_chunk=True)
    prompts = {f"R{i}": [(i * 50 + j) % 997 + 1 for j in range(16)] for i in range(3)}
    for rid, prompt in prompts.items():
        h.submit(rid, prompt, 4)
    h.step()
    prompts["N"] = [(900 + j) % 997 for j in range(20)]
    h.submit("N", prompts["N"], 2)
    with caplog.at_level(logging.WARNING):
        h.run_until_idle()
    assert "Retract" not in caplog.text
    for rid, prompt in prompts.items():
        assert h.outputs[rid] == reference_output(prompt, 2 if rid == "N" else 4)


@pytest.mark.parametrize("overlap", [False, True])
def test_lone_request_waits_for_kv_held_by_an_in_flight_batch(make_harness, overlap):
    """In the overlap loop B finishes while the next decode with it is in flight, so its KV comes
    back a step late; A, alone in the running batch, must wait for it, not be aborted as too big."""
    worker = FakeWorker(max_total_num_tokens=60, max_context_len=512)
    h = make_harness(worker=worker, disable_overlap_schedule=not overlap)
    h.submit("A", list(range(1, 11)), 1000)  # capped to the pool: 49 new tokens
    h.step()
    h.submit("B", list(range(200, 210)), 20)
    h.run_until_idle()
    assert h.finished["A"] == {"type": "length", "length": 49}
    assert h.outputs["A"] == reference_output(list(range(1, 11)), 49)
    assert h.finished["B"]["type"] == "length" and h.scheduler.check_memory_leak() is None


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_only_request_gets_no_decode_forward(make_harness, overlap):
    h = make_harness(disable_overlap_schedule=not overlap)
    h.submit("p", list(range(1, 30)), 0)
    h.run_until_idle()
    assert h.worker.forward_modes == ["EXTEND"] and h.finished["p"] == {"type": "length", "length": 0}
    assert h.scheduler.check_memory_leak() is None


def test_request_that_never_fits_is_aborted(make_harness):
    h = make_harness(worker=FakeWorker(max_total_num_tokens=64))
    h.submit("huge", list(range(100)), 4)
    h.submit("empty", [], 4)
    h.submit("ok", list(range(60)), 100)  # output capped so prompt + output fits the pool
    h.run_until_idle()
    assert h.finished["huge"]["type"] == "abort" and "longer" in h.finished["huge"]["message"]
    assert h.finished["empty"]["type"] == "abort"
    assert h.finished["ok"]["type"] == "length"


def test_flush_cache_and_internal_state(make_harness):
    h = make_harness()
    h.submit("a", list(range(30)), 20)
    h.step()
    h.step([FlushCacheReqInput()])
    refused = h.sent[-1] if not isinstance(h.sent[-1], BatchTokenIDOut) else h.sent[-2]
    assert refused.success is False and "in flight" in refused.message
    h.run_until_idle()
    assert h.scheduler.mem.evictable_size() > 0
    h.step([FlushCacheReqInput(), GetInternalStateReq()])
    flushed, state = h.sent[-2], h.sent[-1].internal_state
    assert flushed.success is True
    assert state["evictable_tokens"] == 0 and state["available_tokens"] == state["max_total_num_tokens"]
    for key in (
        "num_running_reqs",
        "num_waiting_reqs",
        "token_usage",
        "cache_hit_tokens",
        "last_gen_throughput",
    ):
        assert key in state


def test_decode_log_line(make_harness, caplog):
    h = make_harness()
    h.submit("a", [1, 2, 3], 45)
    with caplog.at_level(logging.INFO, logger="radixserve.scheduler"):
        h.run_until_idle()
    assert "Decode batch. #running-req: 1" in caplog.text
    assert "Prefill batch. #new-seq: 1, #new-token: 3, #cached-token: 0" in caplog.text
