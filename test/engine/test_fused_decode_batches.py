"""Decode batches above wq_max_tokens through the compiled stack (cpu_decode_batches.py): where every
decoder linear runs its batches on int8-activation panels (Crossovers.wq_batch_a8, the Zen 4
default), the fused stack takes every decode batch and runs each linear with the kernel
group_quant.wq_kernel names for that row count (a8 up to wq_a8_max_tokens, exact linear_wq up to
wq_max_tokens, the panels above), as the module forward does; forms without panels keep the small
bound and the module forward for the batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from test_cpu_decode_runner import _quantize_rtn, decoder_linears
from test_fused_decode_a8 import _fused_steps
from test_quantization import _worker, compare, forced_logprobs

from radixserve.layers import cpu_crossovers, cpu_fused, group_quant
from radixserve.layers.cpu_crossovers import Crossovers
from radixserve.model_executor.cpu_decode_batches import batches_on_panels, fused_batch_bound
from radixserve.model_executor.cpu_decode_runner import create_cpu_decode_runner
from radixserve.model_executor.tp_worker import TpModelWorker

pytestmark = pytest.mark.skipif(
    not (cpu_fused.ENABLED and group_quant.WQ_A8_PACKED),
    reason="sgl_kernel._cpu built without the int8-activation panel kernel",
)
STEPS = 3
# The served default's shape on Zen 4: int8 activations up to 4 rows, exact linear_wq up to 8,
# the panels' GEMM above.
BATCH_A8 = Crossovers(wq_max_tokens=8, wq_a8_max_tokens=4, wq_batch_a8=True, source="test")


@pytest.fixture
def batch_a8() -> Iterator[None]:
    before = cpu_crossovers.active()
    yield
    cpu_crossovers.install(before)


def _panel_worker(
    path: str, fused: bool, panels: bool, kv: str, bound: Crossovers = BATCH_A8
) -> TpModelWorker:
    """A worker whose decoder linears read Q4_1-like forms marked for int8 activations (with their
    panels where `panels`), under `bound`, the fused decode rebuilt over them with the request
    pool's rows as the largest decode batch."""
    worker = _worker(path, disable_cpu_fused_decode=not fused, kv_cache_dtype=kv)
    cpu_crossovers.install(bound)  # after the worker's own start-up installed its crossovers
    runner = worker.model_runner
    for layer in runner.model.model.layers:
        for lin in decoder_linears(layer):
            wq = group_quant.with_int8_activations(_quantize_rtn(lin.weight.detach(), 4, 32), panels=panels)
            lin.drop_derived()
            lin.weight.data.copy_(wq.dequantize())
            lin.weight_wq = wq
    runner._prepare_cpu_linears()
    made = create_cpu_decode_runner(
        runner.model, runner.token_to_kv_pool, runner.server_args, runner.parallel, None, runner.max_req_num
    )
    runner.cpu_decode_runner = made if fused else None
    return worker


def _prompts(n: int) -> list[list[int]]:
    return [list(range(3 + i % 7, 3 + i % 7 + 4 + i % 5)) for i in range(n)]


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("bs", [1, 8, 9, 16, 64])
def test_batches_on_panels_run_fused_as_the_module_forward(tiny_model_dir, batch_a8, kv, bs):
    path = str(tiny_model_dir("llama"))
    prompts = _prompts(bs)
    ref, fed = forced_logprobs(_panel_worker(path, False, True, kv), prompts, STEPS)
    worker = _panel_worker(path, True, True, kv)
    assert worker.model_runner.cpu_decode_runner.max_bs == worker.model_runner.max_req_num
    calls = _fused_steps(worker)
    got, _ = forced_logprobs(worker, prompts, STEPS, forced=fed)
    assert calls == [bs] * STEPS  # every decode step, batch above wq_max_tokens included, ran fused
    # The same kernel on the same rows: only the fused norms' summation order differs, which may
    # move an activation across an int8 rounding boundary of the next product now and then.
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    assert agreement == 1.0 and mean_diff < 1e-4 and max_diff < 2e-3, (agreement, mean_diff, max_diff)


# A start that timed int8 activations no faster at one row (wq_a8_max_tokens 0) but the batches'
# panels faster (wq_batch_a8): measured so on a Zen 4 at setup. The stack must still be handed the
# panels its batches read (it once refused to build: "no marked wq form with panels").
BATCH_ONLY_A8 = Crossovers(wq_max_tokens=1, wq_a8_max_tokens=0, wq_batch_a8=True, source="test")


@pytest.mark.parametrize("bs", [1, 2, 9])
def test_batch_panels_without_one_row_int8_activations(tiny_model_dir, batch_a8, bs):
    path = str(tiny_model_dir("llama"))
    prompts = _prompts(bs)
    ref, fed = forced_logprobs(_panel_worker(path, False, True, "float32", BATCH_ONLY_A8), prompts, STEPS)
    worker = _panel_worker(path, True, True, "float32", BATCH_ONLY_A8)
    assert worker.model_runner.cpu_decode_runner.max_bs == worker.model_runner.max_req_num
    calls = _fused_steps(worker)
    got, _ = forced_logprobs(worker, prompts, STEPS, forced=fed)
    assert calls == [bs] * STEPS
    agreement, mean_diff, max_diff = compare(ref, got, fed)
    assert agreement == 1.0 and mean_diff < 1e-4 and max_diff < 2e-3, (agreement, mean_diff, max_diff)


def test_batch_steps_read_the_panels(tiny_model_dir, batch_a8):
    """A batch above wq_max_tokens reads the panels, not the forms' row layout (zeroing the latter's
    scales changes none of its numbers), and takes int8 activations (the exact fp32-weight model
    gives other numbers)."""
    path = str(tiny_model_dir("llama"))
    prompts = _prompts(12)
    worker = _panel_worker(path, True, True, "float32")
    got, fed = forced_logprobs(worker, prompts, STEPS)
    for layer in worker.model_runner.model.model.layers:
        for lin in decoder_linears(layer):
            lin.weight_wq.scales.zero_()
    again, _ = forced_logprobs(worker, prompts, STEPS, forced=fed)
    for step, (a, g) in enumerate(zip(again[1:], got[1:]), start=1):  # the prefill read fp32 weights
        torch.testing.assert_close(a, g, atol=0, rtol=0, msg=f"step {step}")
    exact, _ = forced_logprobs(_worker(path, kv_cache_dtype="float32"), prompts, STEPS, forced=fed)
    _, a8_mean, _ = compare(exact[1:], got[1:], fed[1:])
    assert a8_mean > 1e-5, a8_mean


def test_forms_without_panels_keep_the_small_bound(tiny_model_dir, batch_a8):
    """Marked forms without panels run their batches on oneDNN in the module forward (wq_kernel:
    "gemm"), which the stack has not: it keeps wq_max_tokens, and a batch of 9 runs the module
    forward."""
    path = str(tiny_model_dir("llama"))
    worker = _panel_worker(path, True, False, "float32")
    fused = worker.model_runner.cpu_decode_runner
    assert fused.max_bs == BATCH_A8.wq_max_tokens
    assert not batches_on_panels(worker.model_runner.model.model.layers)
    calls = _fused_steps(worker)
    forced_logprobs(worker, _prompts(9), STEPS)
    assert calls == []
    with pytest.raises(RuntimeError, match="no marked wq form with panels"):
        fused.decode_model.set_wq_batch_a8(BATCH_A8.wq_max_tokens)


def test_bound_is_small_with_lora_tp_or_an_unknown_batch(tiny_model_dir, batch_a8):
    path = str(tiny_model_dir("llama"))
    layers = _panel_worker(path, True, True, "float32").model_runner.model.model.layers
    assert batches_on_panels(layers)
    assert fused_batch_bound(layers, 64, single_rank=True, with_lora=False) == 64
    assert fused_batch_bound(layers, 64, single_rank=True, with_lora=True) == 8
    assert fused_batch_bound(layers, 64, single_rank=False, with_lora=False) == 8
    assert fused_batch_bound(layers, 0, single_rank=True, with_lora=False) == 8
    # Batches above the panels' bound run oneDNN's GEMM in the module forward: the stack stops there.
    cpu_crossovers.install(dataclasses.replace(BATCH_A8, wq_batch_a8_max_tokens=16))
    assert fused_batch_bound(layers, 64, single_rank=True, with_lora=False) == 16
    assert fused_batch_bound(layers, 12, single_rank=True, with_lora=False) == 12
