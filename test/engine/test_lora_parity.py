"""LoRA serving vs HF transformers + PEFT: greedy tokens identical for three random adapters of
different ranks and target modules, each alone and all mixed in one batch with base-model
requests, under the --max-loras-per-batch gate and the per-adapter radix cache."""

from __future__ import annotations

import logging
import random
import re

import pytest
import torch
from scheduler_harness import SchedulerRun, until_eos

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import cpu_crossovers, cpu_fused
from radixserve.managers.io_struct import AbortReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.server_args import ServerArgs
from radixserve.testing.tiny_lora import TINY_ADAPTERS, make_tiny_adapter
from radixserve.testing.tiny_models import TINY_VOCAB, hf_greedy

pytest.importorskip("peft")

NUM_NEW = 12
KINDS = ["llama", "qwen3"]


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


PROMPTS = _prompts(7, 3)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """kind -> {adapter name: folder}."""
    made: dict[str, dict[str, str]] = {}

    def get(kind: str) -> dict[str, str]:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"lora_{kind}")
            made[kind] = {
                name: str(make_tiny_adapter(tiny_model_dir(kind), name, root / name, seed=i))
                for i, name in enumerate(TINY_ADAPTERS)
            }
        return made[kind]

    return get


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapters):
    """(kind, adapter or None) -> HF+PEFT greedy continuation of every PROMPTS prompt."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cache: dict[tuple[str, str | None], list[list[int]]] = {}

    def get(kind: str, name: str | None) -> list[list[int]]:
        if (kind, name) not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(kind), dtype=torch.float32)
            if name is not None:
                model = PeftModel.from_pretrained(model, adapters(kind)[name])
            model.eval()
            cache[(kind, name)] = [until_eos(hf_greedy(model, p, NUM_NEW)[0]) for p in PROMPTS]
        return cache[(kind, name)]

    return get


@pytest.fixture(scope="module")
def lora_worker(tiny_model_dir, adapters):
    workers: dict[tuple[str, int], tuple[TpModelWorker, ServerArgs]] = {}

    def get(kind: str, pool: int = 4096) -> tuple[TpModelWorker, ServerArgs]:
        if (kind, pool) not in workers:
            path = tiny_model_dir(kind)
            paths = tuple(f"{n}={p}" for n, p in adapters(kind).items())
            args = ServerArgs(
                model_path=path, max_total_tokens=pool, device="cpu", enable_lora=True, lora_paths=paths
            ).resolve()
            workers[(kind, pool)] = (TpModelWorker(args, ModelConfig.from_path(path, dtype="float32")), args)
        return workers[(kind, pool)]

    return get


def _run(worker_args, requests: list[tuple[str, list[int], str | None]], **overrides) -> SchedulerRun:
    run = SchedulerRun(*worker_args, **overrides)
    for rid, prompt, lora in requests:
        run.submit(rid, prompt, NUM_NEW, lora_id=lora)
    run.run_until_idle()
    return run


@pytest.mark.parametrize("kind", KINDS)
def test_each_adapter_alone_matches_peft(kind, lora_worker, reference):
    for name in [None, *TINY_ADAPTERS]:
        reqs = [(f"{name}-{i}", p, name) for i, p in enumerate(PROMPTS)]
        run = _run(lora_worker(kind), reqs)
        for i, want in enumerate(reference(kind, name)):
            assert run.outputs[f"{name}-{i}"] == want, (name, i)
        run.close()
    # The adapters do change the output (else parity above proves nothing).
    assert all(reference(kind, name) != reference(kind, None) for name in TINY_ADAPTERS)


@pytest.mark.parametrize(
    "overrides",
    [
        {"max_loras_per_batch": 8},
        {"max_loras_per_batch": 2},
        {"max_loras_per_batch": 1},
        # Chunks of 8 tokens with the running decodes riding along, and the overlap loop (the
        # forward on its own thread).
        {"max_loras_per_batch": 2, "chunked_prefill_size": 8, "enable_mixed_chunk": True},
        {"max_loras_per_batch": 2, "enable_overlap_schedule": True, "disable_overlap_schedule": False},
    ],
    ids=["gate8", "gate2", "gate1", "chunked-mixed", "overlap"],
)
def test_adapters_mixed_with_base_in_one_batch(overrides, lora_worker, reference, monkeypatch):
    """Every adapter and the base on the same prompts at once: the outputs are each one's own
    (so no batch mixed up rows, and no adapter reused another's cached prefix), and no forward
    ever holds more adapters than --max-loras-per-batch: the rest wait, and still finish."""
    names = [None, *TINY_ADAPTERS]
    worker, args = lora_worker("llama")
    manager = worker.info.lora
    seen: list[set[str]] = []
    prepare = manager.prepare

    def recording_prepare(batch, num_tokens):
        seen.append({n for n in batch.lora_ids or () if n is not None})
        prepare(batch, num_tokens)

    monkeypatch.setattr(manager, "prepare", recording_prepare)
    reqs = [(f"{name}-{i}", p, name) for name in names for i, p in enumerate(PROMPTS)]
    run = _run((worker, args), reqs, **overrides)
    for name in names:
        for i, want in enumerate(reference("llama", name)):
            assert run.outputs[f"{name}-{i}"] == want, (name, i)
    run.close()
    assert max(len(s) for s in seen) == min(overrides["max_loras_per_batch"], len(TINY_ADAPTERS))


@pytest.mark.skipif(not cpu_fused.ENABLED, reason="sgl_kernel._cpu not built")
def test_mixed_batch_on_the_fused_decode_matches_peft(tiny_model_dir, adapters, reference):
    """Every decode batch on the CPU fused decode (its fp32 bound raised to 16 rows; the default 2
    leaves most of these batches to the module forward): every adapter and the base model, mixed
    in one batch, give PEFT's greedy tokens."""
    path = tiny_model_dir("llama")
    saved = cpu_crossovers.active()
    args = ServerArgs(
        model_path=path,
        max_total_tokens=4096,
        device="cpu",
        lora_paths=tuple(f"{n}={p}" for n, p in adapters("llama").items()),
        cpu_kernel_crossovers='{"f32_small_max_tokens": 16}',
    ).resolve()
    try:
        worker = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))
        fused, adapted_calls = worker.model_runner.cpu_decode_runner, []
        replay = fused.replay
        fused.replay = lambda fb: adapted_calls.append(worker.info.lora.segments is not None) or replay(fb)
        names = [None, *TINY_ADAPTERS]
        run = _run((worker, args), [(f"{n}-{i}", p, n) for n in names for i, p in enumerate(PROMPTS)])
        for name in names:
            for i, want in enumerate(reference("llama", name)):
                assert run.outputs[f"{name}-{i}"] == want, (name, i)
        run.close()
    finally:
        cpu_crossovers.install(saved)  # the worker installed its bound process-wide
    assert len(adapted_calls) >= NUM_NEW - 1 and all(adapted_calls)


def test_no_prefix_reuse_across_adapters(lora_worker, reference):
    """A prompt cached under one adapter is a cache miss for another and for the base model, and
    a hit for the same adapter."""
    prompt = PROMPTS[0]
    run = _run(lora_worker("llama"), [("a", prompt, "attn8")])
    for rid, lora in (("b", "mlp4"), ("base", None), ("a2", "attn8")):
        run.submit(rid, prompt, NUM_NEW, lora_id=lora)
        run.run_until_idle()
    assert run.cached_tokens["b"] == 0 and run.cached_tokens["base"] == 0
    assert run.cached_tokens["a2"] > 0
    assert run.outputs["b"] == reference("llama", "mlp4")[0]
    assert run.outputs["base"] == reference("llama", None)[0]
    run.close()


def test_ngram_speculation_with_adapters(tiny_model_dir, adapters, reference):
    """NGRAM drafts verified under each request's adapter: the same greedy tokens as PEFT."""
    from radixserve.speculative.worker import SpeculativeWorker

    path = tiny_model_dir("llama")
    args = ServerArgs(
        model_path=path,
        max_total_tokens=4096,
        device="cpu",
        lora_paths=tuple(f"{n}={p}" for n, p in adapters("llama").items()),
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=4,
        disable_speculative_batch_backoff=True,
    ).resolve()
    worker = SpeculativeWorker(TpModelWorker(args, ModelConfig.from_path(path, dtype="float32")), None)
    names = [None, *TINY_ADAPTERS]
    # Repeated prompts give the n-gram drafter something to propose.
    prompts = [p * 2 for p in PROMPTS]
    reqs = [(f"{name}-{i}", p, name) for name in names for i, p in enumerate(prompts)]
    run = _run((worker, args), reqs)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for name in names:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters("llama")[name])
        for i, p in enumerate(prompts):
            assert run.outputs[f"{name}-{i}"] == until_eos(hf_greedy(model.eval(), p, NUM_NEW)[0]), (name, i)
    run.close()


def test_retraction_and_abort_with_adapters(lora_worker, reference, caplog):
    """A pool just above one request's need: requests of every adapter are retracted and
    resumed, and still give their adapter's tokens; an aborted adapter request frees its KV."""
    names = [None, *TINY_ADAPTERS]
    largest = max(len(p) for p in PROMPTS) + NUM_NEW
    # An optimistic admission (schedule_conservativeness near 0) overcommits the pool: decodes retract.
    run = SchedulerRun(
        *lora_worker("llama", largest + 8), chunked_prefill_size=16, schedule_conservativeness=0.01
    )
    with caplog.at_level(logging.WARNING, logger="radixserve.scheduler"):
        for name in names:
            for i, p in enumerate(PROMPTS):
                run.submit(f"{name}-{i}", p, NUM_NEW, lora_id=name)
        run.submit("gone", PROMPTS[0], NUM_NEW, lora_id="mlp4")
        run.step()
        run.scheduler.requests.abort(AbortReq(rid="gone"))
        run.run_until_idle()
    assert sum(int(n) for n in re.findall(r"#retracted_reqs: (\d+)", caplog.text)) > 0
    assert run.finished["gone"]["type"] == "abort"
    for name in names:
        for i, want in enumerate(reference("llama", name)):
            assert run.outputs[f"{name}-{i}"] == want, (name, i)
    run.close()


def test_unknown_adapter_reaching_the_scheduler_is_a_400(lora_worker):
    """The TokenizerManager refuses unknown adapters; an in-process caller that skips it gets the
    request finished with a 400, and the scheduler goes on."""
    run = _run(lora_worker("llama"), [("x", PROMPTS[0], "nope"), ("ok", PROMPTS[0], "attn8")])
    assert run.finished["x"]["type"] == "abort" and run.finished["x"]["status_code"] == 400
    assert "nope" in run.finished["x"]["message"]
    assert len(run.outputs["ok"]) > 0
    run.close()
