"""The scheduler over the real TpModelWorker (tiny models) vs HF transformers: greedy outputs are
token-identical under every loop / cache / chunking / paging combination, under retraction, for a
random prefix tree, and prompt logprobs match HF's log_softmax, chunked or not."""

import logging
import re

import pytest
import torch
from scheduler_harness import (
    SchedulerRun,
    WorkerCache,
    hf_prompt_logprobs,
    hf_prompt_top_logprobs,
    prefix_tree_workload,
    shared_prefix_workload,
    until_eos,
)

from radixserve.server_args import ServerArgs
from radixserve.testing.tiny_models import TINY_VOCAB, hf_greedy

WORKLOAD = shared_prefix_workload(seed=1)  # 32 requests: 4 prefixes x 8 questions
TREE = prefix_tree_workload(seed=1, n=220)
CHUNK = 64


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    models = {}

    def get(kind: str):
        if kind not in models:
            path = tiny_model_dir(kind)
            models[kind] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return models[kind]

    return get


@pytest.fixture(scope="module")
def hf_reference(hf_model):
    """HF greedy (full recompute) continuation of every WORKLOAD prompt, cut after EOS; per model."""
    cache = {}

    def get(kind: str) -> dict[str, list[int]]:
        if kind not in cache:
            model = hf_model(kind)
            cache[kind] = {rid: until_eos(hf_greedy(model, p, n)[0]) for rid, p, n in WORKLOAD}
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    return WorkerCache(tiny_model_dir)


@pytest.fixture
def make_run(workers):
    """make_run(kind, page_size, max_total_tokens=4096, **scheduler_args) -> SchedulerRun on a shared
    worker; a run the test did not close (it failed) is cleaned so later tests get empty pools."""
    runs = []

    def factory(kind: str, page_size: int, max_total_tokens: int = 4096, **overrides) -> SchedulerRun:
        worker, args = workers.get(kind, page_size, max_total_tokens)
        run = SchedulerRun(worker, args, **overrides)
        runs.append(run)
        return run

    yield factory
    for run in runs:
        if not run.closed:
            run.force_clean()


def test_workload_shape():
    """The workload exercises what the parity tests claim: shared prefixes, and prompts longer than
    one chunk."""
    assert len(WORKLOAD) >= 32
    lengths = [len(p) for _, p, _ in WORKLOAD]
    assert max(lengths) > CHUNK
    assert len({tuple(p[:20]) for _, p, _ in WORKLOAD}) == 4
    assert len({tuple(p) for _, p, _ in WORKLOAD}) == len(WORKLOAD)


# ---------------------------------------------------------------------------------------------- 1
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunked", [CHUNK, None], ids=["chunk64", "nochunk"])
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "noradix"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_greedy_matches_hf_all_modes(overlap, radix, chunked, page_size, make_run, hf_reference):
    run = make_run(
        "llama",
        page_size,
        disable_overlap_schedule=not overlap,
        disable_radix_cache=not radix,
        chunked_prefill_size=chunked or -1,
    )
    _check_shared_prefix_workload(run, hf_reference("llama"), radix)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_greedy_matches_hf_other_models(kind, make_run, hf_reference):
    run = make_run(kind, 16, disable_overlap_schedule=False, chunked_prefill_size=CHUNK)
    _check_shared_prefix_workload(run, hf_reference(kind), radix=True)


def _check_shared_prefix_workload(run: SchedulerRun, reference: dict[str, list[int]], radix: bool) -> None:
    for rid, prompt, max_new in WORKLOAD:
        run.submit(rid, prompt, max_new)
    run.run_until_idle()
    assert set(run.finished) == {rid for rid, _, _ in WORKLOAD}
    mismatched = {
        rid: (run.outputs.get(rid), ref) for rid, ref in reference.items() if run.outputs.get(rid) != ref
    }
    assert not mismatched, f"{len(mismatched)} requests differ from HF: {mismatched}"
    for rid, _, max_new in WORKLOAD:
        ref = reference[rid]
        expected_type = "length" if len(ref) == max_new else "stop"  # length is checked first
        assert run.finished[rid]["type"] == expected_type, (rid, run.finished[rid])
    if radix:
        assert sum(1 for c in run.cached_tokens.values() if c > 0) >= 4, run.cached_tokens
    else:
        assert all(c == 0 for c in run.cached_tokens.values()), run.cached_tokens
    run.close()


# ---------------------------------------------------------------------------------------------- 2
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_retraction_under_tiny_pool_matches_hf(overlap, page_size, make_run, hf_reference, caplog):
    largest = max(len(p) + n for _, p, n in WORKLOAD)
    pool = -(-(largest + 8) // page_size) * page_size  # just above the largest request's need
    run = make_run(
        "llama",
        page_size,
        max_total_tokens=pool,
        disable_overlap_schedule=not overlap,
        chunked_prefill_size=CHUNK,
    )
    with caplog.at_level(logging.WARNING, logger="radixserve.scheduler"):
        for rid, prompt, max_new in WORKLOAD:
            run.submit(rid, prompt, max_new)
        run.run_until_idle()
    retracted = [int(n) for n in re.findall(r"#retracted_reqs: (\d+)", caplog.text)]
    assert sum(retracted) > 0, "the tiny pool never forced a retraction"
    reference = hf_reference("llama")
    assert all(reason["type"] != "abort" for reason in run.finished.values()), run.finished
    mismatched = {
        rid: (run.outputs.get(rid), ref) for rid, ref in reference.items() if run.outputs.get(rid) != ref
    }
    assert not mismatched, f"{len(mismatched)} requests differ from HF after retraction: {mismatched}"
    run.close()


# ---------------------------------------------------------------------------------------------- 3
@pytest.fixture(scope="module")
def tree_alone(workers, hf_model):
    """Each TREE prompt run alone: a fresh request on an idle scheduler (normal loop, no radix cache,
    no chunking, page 1); a sample of them is checked against HF greedy as well."""
    worker, args = workers.get("llama", 1)
    run = SchedulerRun(
        worker, args, disable_overlap_schedule=True, disable_radix_cache=True, chunked_prefill_size=-1
    )
    alone = {}
    try:
        for rid, prompt, max_new in TREE:
            run.submit(rid, prompt, max_new)
            run.run_until_idle()
            assert rid in run.finished
            alone[rid] = run.outputs[rid]
        run.close()
    finally:
        if not run.closed:
            run.force_clean()
    model = hf_model("llama")
    for rid, prompt, max_new in TREE[::20]:
        assert alone[rid] == until_eos(hf_greedy(model, prompt, max_new)[0]), rid
    return alone


def test_prefix_tree_shape():
    prompts = [tuple(p) for _, p, _ in TREE]
    assert len(prompts) >= 200
    # Prompts that are strict prefixes of other prompts, and prompts sharing a first token.
    as_set = set(prompts)
    assert sum(1 for p in prompts if any(p[:k] in as_set for k in range(1, len(p)))) >= 100
    assert len(as_set) < len(prompts)  # some exact duplicates
    assert max(len(p) for p in prompts) > CHUNK


@pytest.mark.parametrize(
    "overlap, chunked, page_size, pool",
    [(True, CHUNK, 16, 4096), (False, -1, 1, 4096), (True, 16, 1, 4096)],
    ids=["overlap-chunk64-page16", "normal-nochunk-page1", "overlap-chunk16-page1"],
)
def test_random_prefix_tree_matches_alone(overlap, chunked, page_size, pool, make_run, tree_alone):
    run = make_run(
        "llama",
        page_size,
        max_total_tokens=pool,
        disable_overlap_schedule=not overlap,
        chunked_prefill_size=chunked,
    )
    for rid, prompt, max_new in TREE:
        run.submit(rid, prompt, max_new)
    run.run_until_idle()
    assert set(run.finished) == set(tree_alone)
    mismatched = {rid: (run.outputs[rid], ref) for rid, ref in tree_alone.items() if run.outputs[rid] != ref}
    assert not mismatched, f"{len(mismatched)} of {len(TREE)} differ from running alone: {mismatched}"
    assert sum(run.cached_tokens.values()) > 0
    run.close()


# ---------------------------------------------------------------------------------------------- 4
LOGPROB_PROMPTS = [
    [(i * 37 + 11) % (TINY_VOCAB - 3) + 3 for i in range(100)],
    [(i * 53 + 5) % (TINY_VOCAB - 3) + 3 for i in range(45)],
    [(i * 29 + 7) % (TINY_VOCAB - 3) + 3 for i in range(71)],
]


@pytest.mark.parametrize(
    "page_size, chunked",
    [(1, -1), (1, 32), (1, 13), (16, -1), (16, 32), (16, 48)],
    ids=[
        "page1-nochunk",
        "page1-chunk32",
        "page1-chunk13",
        "page16-nochunk",
        "page16-chunk32",
        "page16-chunk48",
    ],
)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_prompt_logprobs_match_hf(overlap, page_size, chunked, make_run, hf_model):
    """input_token_logprobs cover prompt positions logprob_start_len + 1 .. len - 1 (position 0 has
    no logprob), each log P(token | prefix) as HF computes it, whatever the chunking; with
    top_logprobs_num, each position's top-k (input_top_logprobs) is HF's log_softmax top-k."""
    model = hf_model("llama")
    run = make_run("llama", page_size, disable_overlap_schedule=not overlap, chunked_prefill_size=chunked)
    # The logprob requests share batches with plain requests that share their first 60 tokens, so
    # the radix cache has something to offer them (logprob_start_len limits what they may reuse).
    starts = [0, 0, 31]  # 31: the first wanted position is the first token of the second chunk of 32
    for i, prompt in enumerate(LOGPROB_PROMPTS):
        run.submit(f"plain{i}", prompt[:60] + [7, 8, 9], 4)
        run.submit(
            f"lp{i}", prompt, 6, return_logprob=True, logprob_start_len=starts[i], top_logprobs_num=i + 2
        )
    run.run_until_idle()
    for i, prompt in enumerate(LOGPROB_PROMPTS):
        rid, start = f"lp{i}", starts[i]
        ref_tokens, ref_logprobs = hf_greedy(model, prompt, 6)
        assert run.outputs[rid] == until_eos(ref_tokens)
        n_out = len(run.outputs[rid])
        assert run.output_logprobs[rid] == pytest.approx(ref_logprobs[:n_out], abs=1e-4)
        assert run.input_logprob_ids[rid] == prompt[start + 1 :], f"{rid}: prompt positions missing or extra"
        expected = hf_prompt_logprobs(model, prompt)[start:]
        assert run.input_logprobs[rid] == pytest.approx(expected, abs=1e-4), rid
        top_val, top_idx = hf_prompt_top_logprobs(model, prompt, i + 2)
        got = run.input_top[rid]
        assert [[t for _, t in row] for row in got] == top_idx[start:], f"{rid}: top-k token ids"
        flat = [v for row in got for v, _ in row]
        assert flat == pytest.approx([v for row in top_val[start:] for v in row], abs=1e-4), rid
        assert run.outputs[f"plain{i}"] == until_eos(hf_greedy(model, prompt[:60] + [7, 8, 9], 4)[0])
    run.close()


def test_chunk_smaller_than_a_page_is_rejected():
    """Chunks are cut at page boundaries: a chunk size below the page size used to leave every prompt
    longer than it waiting forever (the scheduler never became idle); now the args are refused."""
    with pytest.raises(ValueError, match="chunked-prefill-size"):
        ServerArgs(page_size=16, chunked_prefill_size=13, device="cpu").resolve()
    for chunk in (16, 20, -1):
        assert ServerArgs(page_size=16, chunked_prefill_size=chunk, device="cpu").resolve().page_size == 16
