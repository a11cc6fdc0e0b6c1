"""The CPU fused decode on its step team (sgl-kernel csrc/cpu/thread_pool.h, issue 40) against
the same decode on torch's OpenMP team (RADIXSERVE_STEP_TEAM=0): the same logits, bit for bit,
step after step, for the dense stack (fp16 weights; wq forms on int8-activation panels, the
served GGUF path) and a tiny MoE, at one row and at a batch, with an even split (2 threads), an
uneven one (3 threads on this machine's cores) and one thread (no team)."""

from __future__ import annotations

import pytest
import torch
from test_cpu_decode_moe import _worker as moe_worker
from test_cpu_decode_moe import gguf_folder, monkeypatch_module  # noqa: F401 - fixtures
from test_cpu_decode_runner import _decode_logits, decode_steps
from test_fused_decode_a8 import _marked_wq_worker

from radixserve.layers import cpu_fused, group_quant
from radixserve.layers.moe import fused_moe_a8
from radixserve.model_executor.tp_worker import TpModelWorker
from sgl_kernel import cpu as cpu_kernels

pytestmark = [
    pytest.mark.skipif(
        not (cpu_fused.ENABLED and hasattr(cpu_kernels._lib(), "step_team_stats")),
        reason="sgl_kernel._cpu built without the step team",
    ),
    pytest.mark.timeout(300),
]
STEPS = 4


def _prompts(bs: int) -> list[list[int]]:
    return [list(range(3 + i, 3 + i + 5 + 7 * i)) for i in range(bs)]  # ragged lengths


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _both(monkeypatch, run) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, int]]:
    """run() with the team off, then on: both runs' logits and the team's counters over the second."""
    monkeypatch.setenv("RADIXSERVE_STEP_TEAM", "0")
    off = run()
    monkeypatch.setenv("RADIXSERVE_STEP_TEAM", "1")
    before = cpu_kernels.step_team_stats()
    on = run()
    after = cpu_kernels.step_team_stats()
    return off, on, {k: after[k] - before[k] for k in ("steps", "regions")}


def _assert_same(off: list[torch.Tensor], on: list[torch.Tensor]) -> None:
    assert len(on) == len(off) == STEPS + 1
    for step, (a, b) in enumerate(zip(on, off)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max()}"


def _assert_team_ran(delta: dict[str, int], num_threads: int) -> None:
    if num_threads > 1:
        assert delta["steps"] == STEPS and delta["regions"] > 0, delta
    else:
        assert delta["steps"] == 0, delta  # one thread: no team, at::parallel_for inline


@pytest.mark.parametrize(("bs", "num_threads"), [(1, 2), (4, 2), (4, 3), (1, 3), (4, 1)])
def test_dense_fp16_stack(tiny_model_dir, monkeypatch, threads, bs, num_threads):
    threads(num_threads)
    path = str(tiny_model_dir("llama"))
    off, on, delta = _both(monkeypatch, lambda: _decode_logits(path, True, True, _prompts(bs), STEPS)[0])
    _assert_same(off, on)
    _assert_team_ran(delta, num_threads)


@pytest.mark.skipif(not group_quant.WQ_A8_PACKED, reason="no AVX2 panel kernel here")
@pytest.mark.parametrize(("bs", "num_threads"), [(1, 2), (3, 2), (3, 3)])
def test_wq_forms_on_panels(tiny_model_dir, monkeypatch, threads, bs, num_threads):
    """Q4-like forms with int8-activation panels: one row (at::parallel_for's split) and a batch
    (panel runs the threads pull: parallel_chunks)."""
    threads(num_threads)
    path = str(tiny_model_dir("llama"))

    def run() -> list[torch.Tensor]:
        worker = _marked_wq_worker(path, 4, True, bs, panels=True)
        return decode_steps(worker, _prompts(bs), STEPS)[0]

    off, on, delta = _both(monkeypatch, run)
    _assert_same(off, on)
    _assert_team_ran(delta, num_threads)


@pytest.mark.skipif(not fused_moe_a8.MOE_A8_KERNEL, reason="no moe_wq_a8_packed here")
@pytest.mark.parametrize(("bs", "num_threads"), [(1, 2), (2, 2), (2, 3)])
def test_moe_stack(gguf_folder, monkeypatch, threads, bs, num_threads):  # noqa: F811 - the fixture
    pytest.importorskip("gguf")
    threads(num_threads)
    folder = gguf_folder("qwen2_moe-shared-top2")
    prompts = [[5, 17, 42, 99, 7], [200, 3, 3, 150, 88, 61, 12, 9, 300, 45, 18]][:bs]

    def run() -> list[torch.Tensor]:
        worker: TpModelWorker = moe_worker(folder, fused=True, cpu_wq_int8_activations=True)
        got, calls = decode_steps(worker, prompts, STEPS)
        assert calls == [bs] * STEPS
        return got

    off, on, delta = _both(monkeypatch, run)
    _assert_same(off, on)
    _assert_team_ran(delta, num_threads)
