"""The compiled decode step's thread team (sgl-kernel csrc/cpu/thread_pool.h, issue 40): its
loops split as at::parallel_for splits them, a chunk that raises reaches the caller and leaves the
team usable, the env switches hold, a kernel called outside a step keeps at::parallel_for, and a
DecodeModel step gives the same bits on the team and on torch's OpenMP team. The engine-level
comparisons (dense, MoE, one row and batches, through the served path) are in
test/engine/test_step_team_decode.py."""

from __future__ import annotations

import pytest
import torch
from test_shm_comm_decode_model import HKV, H, _decode_model, _full_layers, _run_steps

from sgl_kernel import cpu as cpu_kernels

pytestmark = [
    pytest.mark.skipif(
        not (cpu_kernels.available() and hasattr(cpu_kernels._lib(), "step_team_probe")),
        reason="sgl_kernel._cpu built without the step team",
    ),
    pytest.mark.timeout(120),
]


@pytest.fixture
def threads():
    """Sets torch's thread count for a test (the team follows it) and restores it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _probe(monkeypatch: pytest.MonkeyPatch, team: bool, n: int, grain: int, throw_at: int = -1) -> list:
    monkeypatch.setenv("RADIXSERVE_STEP_TEAM", "1" if team else "0")
    return cpu_kernels.step_team_probe(n, grain, throw_at)


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize(("n", "grain"), [(10, 3), (7, 1), (64, 0), (5, 5), (1, 0)])
def test_team_splits_as_at_parallel_for(monkeypatch, threads, num_threads, n, grain):
    """The same chunks as at::parallel_for (the team off: its own path), at an even and an uneven
    split (3 threads), one chunk at or below the grain; and the team really ran the region."""
    threads(num_threads)
    reference = _probe(monkeypatch, False, n, grain)
    before = cpu_kernels.step_team_stats()
    got = _probe(monkeypatch, True, n, grain)
    after = cpu_kernels.step_team_stats()
    assert got == reference
    assert after["steps"] == before["steps"] + 1 and after["size"] == num_threads
    assert after["regions"] == before["regions"] + (1 if len(reference) > 1 else 0)


def test_workers_take_chunks(monkeypatch, threads):
    """Not only the stepping thread runs the chunks (each sleeps 200 us; a loaded machine can keep
    a worker off its core for one probe, so a few are allowed)."""
    threads(2)
    before = cpu_kernels.step_team_stats()["worker_chunks"]
    for _ in range(20):
        assert _probe(monkeypatch, True, 16, 1) == [(0, 8), (8, 16)]
        if cpu_kernels.step_team_stats()["worker_chunks"] > before:
            return
    pytest.fail("the team's worker ran none of 20 probes' chunks")


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("throw_at", [0, 5, 11])
def test_a_chunk_that_raises_reaches_the_caller(monkeypatch, threads, num_threads, throw_at):
    """The first chunk (the caller's), a middle and the last (a worker's, most often): the error
    comes back, nothing hangs, and the team runs the next steps whole."""
    threads(num_threads)
    with pytest.raises(RuntimeError, match="throws"):
        _probe(monkeypatch, True, 12, 1, throw_at)
    reference = _probe(monkeypatch, False, 12, 1)
    for _ in range(3):
        assert _probe(monkeypatch, True, 12, 1) == reference


@pytest.mark.parametrize(("yield_us", "sleep_us"), [("0", "0"), ("1", "5"), ("4", "100"), ("bad", "-1")])
def test_wait_policies_run_the_same_chunks(monkeypatch, threads, yield_us, sleep_us):
    """RADIXSERVE_TEAM_YIELD_US / RADIXSERVE_TEAM_SLEEP_US (0: sleep at once; unparsable or
    negative: the defaults) change how workers wait, never what runs."""
    threads(2)
    monkeypatch.setenv("RADIXSERVE_TEAM_YIELD_US", yield_us)
    monkeypatch.setenv("RADIXSERVE_TEAM_SLEEP_US", sleep_us)
    reference = _probe(monkeypatch, False, 9, 2)
    for _ in range(3):
        assert _probe(monkeypatch, True, 9, 2) == reference


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_step_team_off_keeps_at_parallel_for(monkeypatch, threads, value):
    threads(2)
    monkeypatch.setenv("RADIXSERVE_STEP_TEAM", value)
    before = cpu_kernels.step_team_stats()
    assert cpu_kernels.step_team_probe(8, 1) == [(0, 4), (4, 8)]
    assert cpu_kernels.step_team_stats()["steps"] == before["steps"]


def test_one_thread_runs_inline(monkeypatch, threads):
    threads(1)
    before = cpu_kernels.step_team_stats()
    assert _probe(monkeypatch, True, 8, 1) == [(0, 8)]
    assert cpu_kernels.step_team_stats()["steps"] == before["steps"]


def test_a_kernel_called_outside_a_step_keeps_working(monkeypatch, threads):
    """linear_f32 from Python (no step): torch's result, and the team not involved."""
    threads(2)
    monkeypatch.setenv("RADIXSERVE_STEP_TEAM", "1")
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 96, generator=gen), torch.randn(700, 96, generator=gen)
    before = cpu_kernels.step_team_stats()
    y = cpu_kernels.linear_f32(x, w)
    assert cpu_kernels.step_team_stats()["steps"] == before["steps"]
    torch.testing.assert_close(y, x @ w.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("variant", ["fp32", "wq4-bias", "wq8-qk_norm"])
def test_decode_model_steps_match_with_the_team_off(monkeypatch, threads, num_threads, variant):
    """A tiny DecodeModel's steps (2 ragged rows): the same bits on the team as on OpenMP's."""
    threads(num_threads)
    layers = _full_layers(variant)
    monkeypatch.setenv("RADIXSERVE_STEP_TEAM", "0")
    reference = _run_steps(_decode_model(layers, H, HKV, False), steps=3)
    monkeypatch.setenv("RADIXSERVE_STEP_TEAM", "1")
    before = cpu_kernels.step_team_stats()
    got = _run_steps(_decode_model(layers, H, HKV, False), steps=3)
    after = cpu_kernels.step_team_stats()
    assert after["steps"] >= before["steps"] + 3 and after["regions"] > before["regions"]
    for step, (g, r) in enumerate(zip(got, reference)):
        assert torch.equal(g, r), f"step {step}"


def test_a_step_that_raises_leaves_the_team_usable(monkeypatch, threads):
    """A forward refused inside its step (token_slots without LoRA) releases the team: the next
    steps run on it and give the bits they give without the failed one."""
    threads(2)
    monkeypatch.setenv("RADIXSERVE_STEP_TEAM", "1")
    layers = _full_layers("fp32")
    reference = _run_steps(_decode_model(layers, H, HKV, False), steps=2)
    model = _decode_model(layers, H, HKV, False)
    hidden, rows, lens = torch.zeros(1, layers[0]["input_norm"].numel()), torch.tensor([0]), torch.tensor([5])
    req_to_token = torch.arange(64, dtype=torch.int32).view(2, 32)
    with pytest.raises(RuntimeError, match="token_slots"):
        model.forward(hidden, lens - 1, lens - 1, req_to_token, rows, lens, torch.tensor([0]))
    before = cpu_kernels.step_team_stats()["steps"]
    got = _run_steps(model, steps=2)
    assert cpu_kernels.step_team_stats()["steps"] == before + 2
    assert all(torch.equal(g, r) for g, r in zip(got, reference))


def test_a_held_scope_spans_calls(monkeypatch, threads):
    """step_team_held (the fused stack and the LM head in one scope): the kernels called inside
    run on the held team as one step (their own scopes nest and own nothing), a nested hold and a
    hold with the team off take nothing, and the team is free again after the block."""
    threads(2)
    monkeypatch.setenv("RADIXSERVE_STEP_TEAM", "1")
    reference = cpu_kernels.step_team_probe(8, 1)
    before = cpu_kernels.step_team_stats()
    with cpu_kernels.step_team_held() as took:
        assert took
        with cpu_kernels.step_team_held() as nested:
            assert not nested
        for _ in range(3):
            assert cpu_kernels.step_team_probe(8, 1) == reference
    after = cpu_kernels.step_team_stats()
    assert after["steps"] == before["steps"] + 1 and after["regions"] == before["regions"] + 3
    assert cpu_kernels.step_team_probe(8, 1) == reference  # a new step of its own
    assert cpu_kernels.step_team_stats()["steps"] == after["steps"] + 1
    monkeypatch.setenv("RADIXSERVE_STEP_TEAM", "0")
    with cpu_kernels.step_team_held() as took:
        assert not took


def test_a_held_scope_is_released_when_its_block_raises(monkeypatch, threads):
    threads(2)
    monkeypatch.setenv("RADIXSERVE_STEP_TEAM", "1")
    with pytest.raises(ValueError), cpu_kernels.step_team_held() as took:
        assert took
        raise ValueError
    with cpu_kernels.step_team_held() as took:
        assert took
