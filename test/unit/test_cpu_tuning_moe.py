"""The expert path of a weight-only quantized MoE (Crossovers.moe_a8, model_executor/cpu_tuning_moe.py):
measured as the exact grouped path against the one-call panel kernel on the model's own first MoE
layer, the panels chosen only where they won at every token count; cached with the other
crossovers and deterministic given the cache; forced by --cpu-wq-int8-activations and
--disable-cpu-wq-int8-activations; off under `off`; on for a busy start and a multi-rank one where
the kernel is built."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_cpu_tuning import _isolated, _layers  # noqa: F401 - autouse: own cache folder, quiet machine

from radixserve.distributed.communication import TensorParallelComm
from radixserve.layers.group_quant import WQ_A8_PACKED, GroupQuantWeight, pack_int4
from radixserve.layers.linear import onednn_prepack_available
from radixserve.layers.moe import fused_moe_a8
from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.moe.quantized import DequantScratch, ExpertsWq
from radixserve.model_executor import cpu_tuning, cpu_tuning_moe
from radixserve.model_executor.cpu_tuning import cache_path, choose_int8_activations, resolve_crossovers
from radixserve.model_executor.cpu_tuning_moe import measure_moe_a8, moe_identity, quantized_moes

needs_onednn = pytest.mark.skipif(not onednn_prepack_available(), reason="torch built without oneDNN")
needs_moe_kernel = pytest.mark.skipif(not fused_moe_a8.MOE_A8_KERNEL, reason="no moe_wq_a8_packed here")

HIDDEN, INTER, EXPERTS = 64, 32, 10


def _q4_0(n: int, k: int, seed: int) -> GroupQuantWeight:
    gen = torch.Generator().manual_seed(seed)
    scales = ((torch.rand(n, k // 32, generator=gen) - 0.25) * 0.02).half().float()
    q = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    return GroupQuantWeight(q, scales, scales * -8.0, 32, 4, int8_activations=True)


def _moe() -> FusedMoE:
    """A MoE layer served from Q4_0 forms, as a GGUF load leaves it (fp32 experts dropped)."""
    moe = FusedMoE(EXPERTS, HIDDEN, INTER, TensorParallelComm.single())
    w13 = tuple(_q4_0(2 * INTER, HIDDEN, e) for e in range(EXPERTS))
    w2 = tuple(_q4_0(HIDDEN, INTER, 100 + e) for e in range(EXPERTS))
    moe.attach_quantized(ExpertsWq(w13, w2), DequantScratch())
    return moe


def _on_panels(fn) -> bool:  # noqa: ANN001 - a timed pass of measure_moe_a8
    """Whether a pass measure_moe_a8 times runs the panel kernel (else the exact grouped path)."""
    return fn.__defaults__[0].func is cpu_tuning_moe.experts_on_panels


@needs_moe_kernel
def test_real_timings_give_both_paths_and_the_rule() -> None:
    chosen, timings = measure_moe_a8([_moe()])
    assert sorted(timings) == list(cpu_tuning_moe.TOKENS)
    assert all(e > 0 and p > 0 for e, p in timings.values())
    assert chosen == all(p < e for e, p in timings.values())


@needs_moe_kernel
@pytest.mark.parametrize(("panels_ms", "chosen"), [({1: 1.0, 16: 1.5}, True), ({1: 1.0, 16: 3.0}, False)])
def test_the_panels_serve_only_where_they_won_at_every_token_count(monkeypatch, panels_ms, chosen) -> None:
    calls: list[tuple[str, int]] = []

    def best(routes, fn) -> float:  # noqa: ANN001 - the measured function's signature
        tokens = routes[0].shape[0]
        exact = not _on_panels(fn)
        out = fn(routes[0])  # the path runs for real on the route
        assert out is not None and out.shape == (tokens, HIDDEN)
        calls.append(("exact" if exact else "panels", tokens))
        return 2.0 if exact else panels_ms[tokens]

    monkeypatch.setattr(cpu_tuning_moe, "_best_ms", best)
    got, timings = measure_moe_a8([_moe()])
    assert got is chosen
    assert calls == [("exact", 1), ("panels", 1), ("exact", 16), ("panels", 16)]
    assert timings == {t: (2.0, panels_ms[t]) for t in cpu_tuning_moe.TOKENS}


def test_nothing_to_measure_without_quantized_experts() -> None:
    assert measure_moe_a8([]) == (False, {})
    plain = FusedMoE(4, 16, 8, TensorParallelComm.single())
    assert quantized_moes([plain]) == []


def test_the_flags_force_the_expert_path() -> None:
    measured = cpu_tuning.Crossovers(moe_a8=True, wq_a8_max_tokens=2)
    assert choose_int8_activations(measured, None).moe_a8
    assert not choose_int8_activations(measured, False).moe_a8
    assert choose_int8_activations(cpu_tuning.Crossovers(), True).moe_a8


@needs_onednn
def test_cached_deterministic_and_keyed_on_the_experts(monkeypatch) -> None:
    layers, moe = _layers(), _moe()
    # The panels win (1 ms against 2): what is cached is what the rule made of the timings.
    monkeypatch.setattr(cpu_tuning_moe, "_best_ms", lambda routes, fn: 1.0 if _on_panels(fn) else 2.0)
    chosen = resolve_crossovers("auto", None, [*layers, moe], world_size=1)
    assert chosen.moe_a8 == fused_moe_a8.MOE_A8_KERNEL
    path = cache_path(layers, moe_identity([moe]))
    assert path != cache_path(layers)  # the experts are part of the key
    assert json.loads(path.read_text())["moe_a8"] == chosen.moe_a8
    # A second start reads the cache, whatever a measurement would say now.
    monkeypatch.setattr(cpu_tuning, "measure", lambda layers: pytest.fail("measured again"))
    monkeypatch.setattr(cpu_tuning, "measure_moe_a8", lambda moes: pytest.fail("measured again"))
    again = resolve_crossovers("auto", None, [*layers, moe], world_size=1)
    assert again.moe_a8 == chosen.moe_a8 and "cached" in again.source
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "moe_a8": not chosen.moe_a8}))
    assert resolve_crossovers("auto", None, [*layers, moe], world_size=1).moe_a8 is not chosen.moe_a8
    # --disable-cpu-wq-int8-activations keeps the exact path whatever the cache says.
    assert not resolve_crossovers("auto", None, [*layers, moe], 1, int8_activations=False).moe_a8


@needs_onednn
def test_off_keeps_the_exact_path_and_busy_and_multi_rank_serve_the_kernel(monkeypatch) -> None:
    layers, moe = _layers(), _moe()
    monkeypatch.setattr(cpu_tuning, "measure_moe_a8", lambda moes: pytest.fail("measured"))
    assert not resolve_crossovers("off", None, [*layers, moe], 1).moe_a8
    # Multi-rank: nothing measured (each rank would time alone), the same unmeasured defaults as a
    # busy start, so every rank resolves alike from the model and the build.
    multi = resolve_crossovers("auto", None, [*layers, moe], 2)
    assert multi.moe_a8 == fused_moe_a8.MOE_A8_KERNEL and "multi-rank" in multi.source
    monkeypatch.setattr(cpu_tuning, "machine_busy", lambda: "machine busy (load 5.0 on 2 CPUs)")
    busy = resolve_crossovers("auto", None, [*layers, moe], 1)
    assert busy.moe_a8 == fused_moe_a8.MOE_A8_KERNEL and "busy" in busy.source
    assert dataclasses.replace(multi, source="") == dataclasses.replace(busy, source="")
    assert not resolve_crossovers("auto", None, layers, 2).moe_a8  # a dense model: exact, as before
    dense = resolve_crossovers("auto", None, layers, 1)
    assert not dense.moe_a8 and dense.wq_a8_max_tokens == 0  # no quantized experts: exact
    # The MoE's marked dense layers (its LM head) take int8 activations at one row on their own
    # panels; unmarked ones (these) stay exact.
    assert (busy.wq_a8_max_tokens, busy.wq_a8_small_panels) == (0, False)
    for m in layers:
        m.weight_wq = dataclasses.replace(m.weight_wq, int8_activations=True)
    marked = resolve_crossovers("auto", None, [*layers, moe], 1)
    one_row = 1 if fused_moe_a8.MOE_A8_KERNEL and WQ_A8_PACKED else 0
    assert (marked.wq_a8_max_tokens, marked.wq_a8_small_panels) == (one_row, bool(one_row))
