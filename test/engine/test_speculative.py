"""Speculative decoding over the real TpModelWorker (tiny models): greedy output is token-identical
to plain decoding with NGRAM drafts and with an oracle drafter whose drafts are right or wrong at
will (full, partial and zero acceptance), on both CPU attention backends, page_size 1 and 16, with
radix hits, retraction, aborts, stop tokens and strings, and requests that do not speculate riding
along. Every run ends with no KV slot or row leaked and a radix cache holding only accepted tokens."""

from __future__ import annotations

import pytest
from scheduler_harness import SchedulerRun, shared_prefix_workload
from spec_harness import SPEC, OracleDrafter, abort_mid_speculation, copy_workload, submit, use_oracle

WORKLOAD = shared_prefix_workload(seed=3, groups=2, per_group=4) + copy_workload(seed=3)


def _plain(make_run, backend: str, page_size: int, workload=WORKLOAD, **kw) -> dict[str, list[int]]:
    run = make_run(backend, page_size, **kw)
    for rid, prompt, n in workload:
        run.submit(rid, prompt, n)
    run.run_until_idle()
    outputs = dict(run.outputs)
    run.close()
    return outputs


def _cached_sequences_are_accepted(run: SchedulerRun, sequences: list[list[int]]) -> None:
    """Every token path in the radix tree is a prefix of some request's prompt + output."""
    cache = run.scheduler.mem.tree_cache
    stack = [(cache.root, [])]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            key = path + list(child.key)
            assert any(s[: len(key)] == key for s in sequences), f"cached path {key} was never accepted"
            stack.append((child, key))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "noradix"])
def test_oracle_drafts_are_exact(backend, page_size, radix, make_run):
    reference = _plain(make_run, backend, page_size, disable_radix_cache=not radix)
    run = make_run(backend, page_size, disable_radix_cache=not radix, **SPEC)
    use_oracle(run, OracleDrafter(reference, max_drafts=5, error_rate=0.15))
    for rid, prompt, n in WORKLOAD:
        run.submit(rid, prompt, n)
    run.run_until_idle()
    assert run.outputs == reference
    stats = run.scheduler.output.stats
    assert stats.spec_num_accepted > 0 and stats.spec_num_accepted < stats.spec_num_drafts
    # Radix hits happened (shared prefixes), and the tree holds only accepted tokens.
    if radix:
        assert sum(1 for c in run.cached_tokens.values() if c > 0) >= 2
        _cached_sequences_are_accepted(run, [p + reference[rid] for rid, p, _ in WORKLOAD])
    run.close()  # asserts no KV slot or row leaked


@pytest.mark.parametrize("page_size", [1, 16])
def test_ngram_is_exact(page_size, make_run):
    reference = _plain(make_run, "cpu", page_size)
    run = make_run("cpu", page_size, **SPEC)
    for rid, prompt, n in WORKLOAD:
        run.submit(rid, prompt, n)
    run.run_until_idle()
    assert run.outputs == reference
    assert run.scheduler.output.stats.spec_num_rounds > 0
    run.close()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_oracle_exact_other_models(kind, make_run):
    reference = _plain(make_run, "cpu", 16, kind=kind)
    run = make_run("cpu", 16, kind=kind, **SPEC)
    use_oracle(run, OracleDrafter(reference, max_drafts=5, error_rate=0.2))
    for rid, prompt, n in WORKLOAD:
        run.submit(rid, prompt, n)
    run.run_until_idle()
    assert run.outputs == reference
    run.close()


@pytest.mark.parametrize("page_size", [1, 16])
def test_chain_verify_through_the_fused_decode_stack_is_exact(page_size, workers, make_run):
    """Chain verify steps of up to the fused stack's rows run as decode rows of their requests
    (cpu_decode_runner.verify_rows_as_decode_rows): the output is plain decoding's, the module
    forward's verify gives the same, and the fused stack did take verify steps. Its row limit is
    raised to 16 here (fp32's own is 2 rows) so that whole verify batches go through it."""
    reference = _plain(make_run, "cpu", page_size)
    worker, _ = workers.get("llama", "cpu", page_size)
    fused = worker.inner.model_runner.cpu_decode_runner
    assert fused is not None
    module_verify = make_run("cpu", page_size, **SPEC)
    use_oracle(module_verify, OracleDrafter(reference, max_drafts=3, error_rate=0.15))
    for rid, prompt, n in WORKLOAD:
        module_verify.submit(rid, prompt, n)
    worker.inner.model_runner.cpu_decode_runner = None  # every verify step through the module forward
    try:
        module_verify.run_until_idle()
    finally:
        worker.inner.model_runner.cpu_decode_runner = fused
    assert module_verify.outputs == reference
    module_verify.close()
    verify_rows = []
    replay = fused.replay

    def counting_replay(fb):
        if fb.forward_mode.is_target_verify():
            verify_rows.append(int(fb.input_ids.shape[0]))
        return replay(fb)

    fused.replay, old_max = counting_replay, fused.max_bs
    fused.max_bs = 16
    try:
        run = make_run("cpu", page_size, **SPEC)
        use_oracle(run, OracleDrafter(reference, max_drafts=3, error_rate=0.15))
        for rid, prompt, n in WORKLOAD:
            run.submit(rid, prompt, n)
        run.run_until_idle()
    finally:
        fused.replay, fused.max_bs = replay, old_max
    assert run.outputs == reference
    # Verify steps of several requests' chains at once (the batch is 16 requests: the last ones).
    assert len(verify_rows) >= 3 and max(verify_rows) > 4
    assert run.scheduler.output.stats.spec_num_accepted > 0
    run.close()


@pytest.mark.parametrize("page_size", [1, 16])
def test_retraction_mid_speculation(page_size, make_run):
    """A pool just above one request's need: decodes are retracted and re-admitted; drafts shrink
    to a plain decode when their KV does not fit. Output unchanged."""
    workload = shared_prefix_workload(seed=1)
    largest = max(len(p) + n for _, p, n in workload)
    pool = -(-(largest + 8) // page_size) * page_size
    reference = _plain(make_run, "cpu", page_size, workload=workload)
    run = make_run("cpu", page_size, pool=pool, chunked_prefill_size=64, **SPEC)
    use_oracle(run, OracleDrafter(reference, max_drafts=5, error_rate=0.1))
    for rid, prompt, n in workload:
        run.submit(rid, prompt, n)
    run.run_until_idle()
    assert run.outputs == reference
    assert run.scheduler.output.stats.num_retracted_reqs > 0
    assert run.scheduler.output.stats.spec_num_accepted > 0
    run.close()


def test_abort_mid_speculation(make_run):
    reference = _plain(make_run, "cpu", 16)
    run = make_run("cpu", 16, **SPEC)
    use_oracle(run, OracleDrafter(reference, max_drafts=5, error_rate=0.1))
    abort_mid_speculation(run, reference, WORKLOAD, {rid for rid, _, _ in WORKLOAD[::3]})
    run.close()


def test_stop_tokens_inside_an_accepted_run(make_run):
    """A stop token in the middle of a round's accepted drafts ends the request there."""
    reference = _plain(make_run, "cpu", 1)
    run = make_run("cpu", 1, **SPEC)
    use_oracle(run, OracleDrafter(reference, max_drafts=5, error_rate=0.0))
    expected = {}
    for rid, prompt, n in WORKLOAD:
        ref = reference[rid]
        stop = ref[len(ref) // 2]
        expected[rid] = ref[: ref.index(stop) + 1]
        submit(run, rid, prompt, max_new_tokens=n, temperature=0.0, stop_token_ids=[stop])
    run.run_until_idle()
    assert run.outputs == expected
    run.close()


def test_stop_strings_mid_speculation(make_run, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    reference = _plain(make_run, "cpu", 1)

    def run_with(spec: bool) -> tuple[dict, dict]:
        run = make_run("cpu", 1, **(SPEC if spec else {}))
        run.scheduler.tokenizer = tok
        if spec:
            use_oracle(run, OracleDrafter(reference, max_drafts=5, error_rate=0.0))
        for rid, prompt, n in WORKLOAD:
            text = tok.decode(reference[rid])
            stop = text[len(text) // 2 : len(text) // 2 + 2]
            submit(run, rid, prompt, max_new_tokens=n, temperature=0.0, stop=[stop] if stop.strip() else None)
            run.scheduler.requests.state.live[rid].tokenizer = tok
        run.run_until_idle()
        result = dict(run.outputs), dict(run.finished)
        run.close()
        return result

    plain_out, plain_fin = run_with(False)
    spec_out, spec_fin = run_with(True)
    assert spec_out == plain_out
    assert spec_fin == plain_fin
    assert any(f.get("type") == "stop" for f in spec_fin.values())


def test_requests_that_do_not_speculate_ride_along(make_run):
    """Seeded sampling, penalties, min_new_tokens and logprobs beside drafting requests: each gets
    what it gets without speculation."""
    params = [
        dict(temperature=0.8, top_p=0.9, seed=7),
        dict(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=0.0, repetition_penalty=1.3),
        dict(temperature=0.0, min_new_tokens=30),
        dict(temperature=0.0, return_logprob=True),
        dict(temperature=0.0),
    ]
    workload = copy_workload(seed=9, n=len(params) * 2)

    def run_all(spec: bool) -> tuple[dict, dict, int]:
        run = make_run("cpu", 16, **(SPEC if spec else {}))
        for (rid, prompt, n), p in zip(workload, params * 2):
            submit(run, rid, prompt, max_new_tokens=n, **dict(p))
        run.run_until_idle()
        result = dict(run.outputs), dict(run.output_logprobs), run.scheduler.output.stats.spec_num_rounds
        run.close()
        return result

    plain_out, plain_lp, _ = run_all(False)
    spec_out, spec_lp, rounds = run_all(True)
    assert spec_out == plain_out
    asked = [rid for (rid, _, _), p in zip(workload, params * 2) if p.get("return_logprob")]
    for rid in asked:
        assert len(spec_lp[rid]) == len(spec_out[rid])
        assert spec_lp[rid] == pytest.approx(plain_lp[rid], abs=1e-4)
    assert rounds > 0


def test_meta_counters_reach_the_message(make_run):
    reference = _plain(make_run, "cpu", 1)
    run = make_run("cpu", 1, **SPEC)
    use_oracle(run, OracleDrafter(reference, max_drafts=5, error_rate=0.0))
    rid, prompt, n = WORKLOAD[-1]
    run.submit(rid, prompt, n)
    run.run_until_idle()
    last = [m for m in run.sent if getattr(m, "spec_verify_ct", None) is not None][-1]
    verify_ct, tokens = last.spec_verify_ct[0], last.spec_verify_tokens[0]
    # All drafts right: 6 tokens per round, so about n / 6 rounds, and every token but the
    # prefill's came from a verify round.
    assert tokens == len(reference[rid]) - 1
    assert verify_ct <= -(-tokens // 6) + 1
    # Each round gives its accepted drafts + 1, except a last one cut short by a stop token.
    assert tokens - verify_ct <= last.spec_accept_token_num[0] <= tokens - verify_ct + 1
    run.close()


STANDALONE = {
    "speculative_algorithm": "STANDALONE",
    "speculative_draft_layers": 1,
    "speculative_num_draft_tokens": 4,
    "speculative_eagle_topk": 1,
    "disable_speculative_batch_backoff": True,
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_self_speculation_is_exact(backend, page_size, workers, make_run):
    """STANDALONE with the target's first layer as the draft (it shares the target's KV pool)."""
    from radixserve.speculative.layer_skip_draft import LayerSkipDraft

    reference = _plain(make_run, backend, page_size)
    worker, _ = workers.get("llama", backend, page_size)
    draft = LayerSkipDraft(worker.inner.model_runner, STANDALONE["speculative_draft_layers"])
    outputs, stats = _drafted(make_run, worker, draft, backend, page_size, STANDALONE)
    assert outputs == reference
    assert stats.spec_num_rounds > 0 and stats.spec_num_drafts > 0


def _drafted(make_run, worker, draft, backend: str, page_size: int, spec: dict) -> tuple[dict, object]:
    """WORKLOAD through a run whose worker drafts with `draft`: its outputs and scheduler stats."""
    worker.draft = draft
    try:
        run = make_run(backend, page_size, **spec)
        for rid, prompt, n in WORKLOAD:
            run.submit(rid, prompt, n)
        run.run_until_idle()
        outputs, stats = dict(run.outputs), run.scheduler.output.stats
        run.close()
        return outputs, stats
    finally:
        worker.draft = None


def test_sampled_requests_speculate_by_rejection(make_run):
    """Unseeded sampling drafts too (rejection sampling): the run finishes every request with its
    full length or a stop, drafts were verified, and no KV leaked."""
    run = make_run("cpu", 16, **SPEC)
    for rid, prompt, n in copy_workload(seed=11):
        submit(run, rid, prompt, max_new_tokens=n, temperature=0.3, top_p=0.95, ignore_eos=True)
    run.run_until_idle()
    assert all(len(run.outputs[rid]) == n for rid, _, n in copy_workload(seed=11))
    stats = run.scheduler.output.stats
    assert stats.spec_num_rounds > 0 and stats.spec_num_accepted > 0
    run.close()


def test_overlap_loop_refuses_speculation(make_run):
    with pytest.raises(ValueError, match="normal loop only"):
        make_run("cpu", 1, **{**SPEC, "disable_overlap_schedule": False})  # builds its loop


DRAFT_MODEL = {
    "speculative_algorithm": "STANDALONE",
    "speculative_num_draft_tokens": 4,
    "speculative_eagle_topk": 1,
    "disable_speculative_batch_backoff": True,
}


def _with_draft_model(workers, make_run, tiny_model_dir, backend: str, page_size: int, draft_kind: str):
    """WORKLOAD drafted by the tiny `draft_kind` model (its own KV pool): outputs and stats."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.speculative.draft_model import DraftModel

    worker, args = workers.get("llama", backend, page_size)
    config = ModelConfig.from_path(str(tiny_model_dir(draft_kind)), dtype="float32")
    draft = DraftModel(worker.inner.model_runner, config, args)
    return _drafted(make_run, worker, draft, backend, page_size, DRAFT_MODEL)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_draft_model_is_exact(backend, page_size, workers, make_run, tiny_model_dir):
    """STANDALONE with a separate draft model (tiny Qwen2, another architecture with the target's
    vocabulary): the output is the plain one, radix hits included, and no slot leaks."""
    reference = _plain(make_run, backend, page_size)
    outputs, stats = _with_draft_model(workers, make_run, tiny_model_dir, backend, page_size, "qwen2")
    assert outputs == reference
    assert stats.spec_num_rounds > 0 and stats.spec_num_drafts > 0


def test_draft_model_kv_follows_the_target(workers, make_run, tiny_model_dir):
    """The target as its own draft model: its drafts are the target's greedy tokens whenever the
    draft's pool holds the right K/V for every earlier token (prompt prefills, radix hits, plain
    decodes, every verify row), so nearly every draft is accepted. A missing or stale K/V anywhere
    makes the two models' next tokens part, and acceptance falls."""
    reference = _plain(make_run, "cpu", 16)
    outputs, stats = _with_draft_model(workers, make_run, tiny_model_dir, "cpu", 16, "llama")
    assert outputs == reference
    assert stats.spec_num_drafts > 100
    # Not exactly 1: a verify forward (extend kernel) and a draft decode may round the same
    # logits differently, and a near-tie can then pick another argmax.
    assert stats.spec_num_accepted / stats.spec_num_drafts > 0.95, vars(stats)


def test_draft_model_with_another_vocabulary_is_refused(workers, tiny_model_dir):
    from radixserve.configs.model_config import ModelConfig
    from radixserve.speculative.draft_model import DraftModel

    worker, args = workers.get("llama", "cpu", 1)
    config = ModelConfig.from_path(str(tiny_model_dir("llama_kv1")), dtype="float32")
    with pytest.raises(ValueError, match="vocabulary"):
        DraftModel(worker.inner.model_runner, config, args)


def test_worker_builds_the_draft_model_from_server_args(tiny_model_dir):
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.worker_stack import build_model_worker
    from radixserve.server_args import ServerArgs
    from radixserve.speculative.draft_model import DraftModel

    target = str(tiny_model_dir("llama"))
    args = ServerArgs(
        model_path=target,
        device="cpu",
        max_total_tokens=512,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(tiny_model_dir("qwen2")),
    ).resolve()
    worker = build_model_worker(args, ModelConfig.from_path(target, dtype="float32"))
    assert isinstance(worker.draft, DraftModel)
    assert worker.draft.req_to_token_pool is worker.pools.req_to_token_pool  # slots shared, K/V not
    assert worker.draft.kv_pool is not worker.pools.token_to_kv_pool
