"""LoRA on the CPU fused decode (csrc/cpu/decode_lora.cpp inside DecodeModel) against the module
forward with LoRA, its reference (itself checked against HF + PEFT: test_lora_parity.py).

Three adapters of different ranks and target modules mixed with base-model rows in one decode
batch give the module forward's logits step after step and its greedy tokens; an adapter copied
into a slot between two steps (the same slot, new contents; an unload and a load) is what the next
fused step reads. Tolerance: atol = rtol = 1e-4 on fp32 logits, the fused decode's own bound
against the module forward without LoRA (test_cpu_decode_runner.py): the same kernels on both
paths, only the fused norms' summation order differs.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import cpu_crossovers, cpu_fused
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from radixserve.testing.tiny_lora import TINY_ADAPTERS, make_tiny_adapter

pytestmark = pytest.mark.skipif(not cpu_fused.ENABLED, reason="sgl_kernel._cpu not built")

# Every decode batch here (at most 16 rows) takes the fused path: the fp32 small-M bound raised from
# its default of 2. Both paths run with it, so their linears run the same kernels.
CROSSOVERS = json.dumps({"f32_small_max_tokens": 16})
NAMES: list[str | None] = [None, *TINY_ADAPTERS]
ATOL = RTOL = 1e-4


@pytest.fixture(autouse=True)
def _restore_crossovers():
    """The workers install CROSSOVERS process-wide (as a server does once at start): put back what
    was there for the tests after these."""
    saved = cpu_crossovers.active()
    yield
    cpu_crossovers.install(saved)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """kind -> {adapter name: folder}."""
    pytest.importorskip("peft")
    made: dict[str, dict[str, str]] = {}

    def get(kind: str) -> dict[str, str]:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"lora_fused_{kind}")
            made[kind] = {
                name: str(make_tiny_adapter(tiny_model_dir(kind), name, root / name, seed=i))
                for i, name in enumerate(TINY_ADAPTERS)
            }
        return made[kind]

    return get


class Recorder:
    """A worker whose every step's logits are kept, and whose fused calls are counted with
    whether the call had adapted rows."""

    def __init__(self, path: str, adapters: dict[str, str], fused: bool, **lora_args: object) -> None:
        args = ServerArgs(
            model_path=path,
            max_total_tokens=4096,
            device="cpu",
            lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()),
            disable_cpu_fused_decode=not fused,
            cpu_kernel_crossovers=CROSSOVERS,
            **lora_args,
        ).resolve()
        self.worker = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))
        model_runner = self.worker.model_runner
        assert (model_runner.cpu_decode_runner is not None) == fused
        self.lora = model_runner.lora
        self.logits: list[torch.Tensor] = []
        self.fused_calls: list[tuple[int, bool]] = []  # (rows, any adapted row)
        if fused:
            fused_runner = model_runner.cpu_decode_runner
            replay = fused_runner.replay

            def counting_replay(fb):
                self.fused_calls.append((fb.batch_size, self.lora.segments is not None))
                return replay(fb)

            fused_runner.replay = counting_replay
        processor = model_runner.logits_processor

        def record(hidden, lm_head, fb):
            fb.argmax_only = False  # the full logits are compared, not a greedy head's argmax
            out = processor(hidden, lm_head, fb)
            self.logits.append(out.next_token_logits.clone())
            return out

        model_runner.logits_processor = record
        self.runner = StaticBatchRunner(self.worker)


def _reqs(prompts: list[list[int]], names: list[str | None], steps: int) -> list[StaticReq]:
    params = SamplingParams(max_new_tokens=steps + 1, temperature=0.0)
    return [StaticReq(p, params, lora_id=n) for p, n in zip(prompts, names)]


def _assert_steps_close(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for step, (g, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(g, r, atol=ATOL, rtol=RTOL, msg=f"step {step}")


@pytest.mark.parametrize(
    ("kind", "fp16"), [("llama", False), ("qwen2", False), ("qwen3", False), ("llama", True)]
)
def test_mixed_adapters_and_base_rows_match_the_module_forward(kind, fp16, tiny_model_dir, adapters):
    """4 prompts, each under the base model and every adapter: 16 rows in every decode batch. With
    --cpu-fp16-weights the projections read fp16 copies and the delta is added to their output."""
    path = str(tiny_model_dir(kind))
    prompts = [list(range(3 + i, 3 + i + 5 + 7 * i)) for i in range(4)]  # ragged lengths
    rows = [(p, n) for p in prompts for n in NAMES]
    steps = 6
    results = {}
    for fused in (False, True):
        rec = Recorder(path, adapters(kind), fused, cpu_fp16_weights=fp16)
        reqs = _reqs([p for p, _ in rows], [n for _, n in rows], steps)
        rec.runner.prefill(reqs)
        for _ in range(steps):
            rec.runner.decode(reqs)
        results[fused] = (rec, [r.output_ids for r in reqs])
    (ref, ref_tokens), (got, got_tokens) = results[False], results[True]
    assert got.fused_calls == [(len(rows), True)] * steps  # every decode step, and no prefill
    _assert_steps_close(got.logits, ref.logits)
    assert got_tokens == ref_tokens
    # The adapters change every prompt's logits (else the comparison above proves little).
    first_decode = got.logits[1].view(len(prompts), len(NAMES), -1)  # [prompt, name, vocab]
    for adapted in range(1, len(NAMES)):
        assert (first_decode[:, adapted] - first_decode[:, 0]).abs().amax(-1).min() > 1e-2


def test_slot_contents_changed_between_steps(tiny_model_dir, adapters):
    """One slot: every step's adapter replaces the previous one in slot 0, and midway an adapter
    is unloaded and another (new name, another adapter's files) loaded: the fused step after each
    change reads the new contents, as the module forward does."""
    path = str(tiny_model_dir("llama"))
    files = adapters("llama")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    schedule = ["attn8", "mlp4", "all16", "attn8", "fresh", "mlp4", "fresh"]
    results = {}
    for fused in (False, True):
        rec = Recorder(path, files, fused, max_loras_per_batch=1)
        reqs = _reqs(prompts, ["all16", None, "all16"], len(schedule))
        rec.runner.prefill(reqs)
        for step, name in enumerate(schedule):
            if step == 4:  # between two steps: unload one adapter, load another in its place
                rec.lora.unload_adapter("attn8")
                rec.lora.load_adapter("fresh", files["all16"])
            reqs[0].lora_id = reqs[2].lora_id = name  # rows 0 and 2 adapted, row 1 the base
            rec.runner.decode(reqs)
        results[fused] = (rec, [r.output_ids for r in reqs])
    (ref, ref_tokens), (got, got_tokens) = results[False], results[True]
    assert got.fused_calls == [(len(prompts), True)] * len(schedule)
    _assert_steps_close(got.logits, ref.logits)
    assert got_tokens == ref_tokens


def test_base_only_decode_on_a_lora_server_passes_no_slots(tiny_model_dir, adapters):
    """A decode batch without adapter rows runs the stack with no LoRA work at all, and gives the
    logits of a server without --enable-lora."""
    path = str(tiny_model_dir("llama"))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    rec = Recorder(path, adapters("llama"), True)
    reqs = _reqs(prompts, [None, None], 3)
    rec.runner.prefill(reqs)
    for _ in range(3):
        rec.runner.decode(reqs)
    assert rec.fused_calls == [(2, False)] * 3
    args = ServerArgs(
        model_path=path, max_total_tokens=4096, device="cpu", cpu_kernel_crossovers=CROSSOVERS
    ).resolve()
    plain = StaticBatchRunner(TpModelWorker(args, ModelConfig.from_path(path, dtype="float32")))
    plain_reqs = _reqs(prompts, [None, None], 3)
    plain.generate(plain_reqs, 4)
    assert [r.output_ids for r in plain_reqs] == [r.output_ids for r in reqs]


def test_slots_the_stack_cannot_take_fall_back_with_a_reason(tiny_model_dir, caplog):
    """A rank above the compiled delta's bound (its rank-r intermediate lives on the stack): the
    module forward runs LoRA decode batches, and the log says why at start."""
    path = str(tiny_model_dir("llama"))
    args = ServerArgs(
        model_path=path, max_total_tokens=1024, device="cpu", enable_lora=True, max_lora_rank=600
    ).resolve()
    with caplog.at_level(logging.INFO, logger="radixserve.model_executor.cpu_decode_runner"):
        worker = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))
    assert worker.model_runner.cpu_decode_runner is None
    assert "CPU fused decode off" in caplog.text and "rank 600" in caplog.text
