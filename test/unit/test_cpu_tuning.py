"""--cpu-kernel-tuning: the per-machine crossovers of the CPU linear forms (model_executor/cpu_tuning.py).

The choice is deterministic given the cached measurement: a cache file is read without measuring,
a measurement (timings faked here: real ones depend on the machine) picks the last size where the
small kernel wins and is cached, a busy machine or a multi-rank run serves the defaults, and
linear() and the fused decode path follow whatever is installed."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import cpu_crossovers
from radixserve.layers import linear as linear_module
from radixserve.layers.cpu_crossovers import DEFAULTS, Crossovers, active, install, parse_overrides
from radixserve.layers.linear import Linear, onednn_prepack_available, prepare_cpu_linears
from radixserve.layers.weight_only import quantize_int8_groups
from radixserve.model_executor import cpu_tuning
from radixserve.model_executor.cpu_tuning import cache_path, resolve_crossovers
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.server_args import ServerArgs

needs_onednn = pytest.mark.skipif(not onednn_prepack_available(), reason="torch built without oneDNN")


# The bounds of the cache entries the tests write (cache_only).
CACHED_BOUNDS = {"wq_max_tokens": 6, "f32_small_max_tokens": 2, "f16_max_tokens": 16}

# The real check, kept before the autouse fixture below replaces it for every test.
REAL_MACHINE_BUSY = cpu_tuning.machine_busy


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Iterator[None]:
    """Each test gets its own cache folder and leaves the process's crossovers as it found them."""
    monkeypatch.setenv("RADIXSERVE_CPU_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_tuning, "machine_busy", lambda: "")
    before = active()
    yield
    cpu_crossovers._active = before


def cache_only(monkeypatch: pytest.MonkeyPatch, layers: list[Linear]) -> Callable[[dict[str, Any]], None]:
    """A writer of `layers`' tuning cache entry ({"bounds": ..., **entries}); from the first call on
    a measurement fails the test, so what resolve_crossovers answers comes from the cache (or the
    flags and modes over it)."""
    path = cache_path(layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(cpu_tuning, "measure", lambda layers: pytest.fail("measured despite the cache"))

    def write(entries: dict[str, Any]) -> None:
        path.write_text(json.dumps({"bounds": CACHED_BOUNDS, **entries}))

    return write


def _layers(wq: bool = True) -> list[Linear]:
    torch.manual_seed(0)
    layers = [Linear(64, 96, bias=False), Linear(96, 64, bias=False)]
    if wq:
        for m in layers:
            m.weight_wq = quantize_int8_groups(m.weight.data, 32)
            m.weight.data.copy_(m.weight_wq.dequantize())  # as a GGUF load: fp32 = the exact dequantization
    prepare_cpu_linears(layers, fp16=False, prepack=True)
    return layers


def _fake_timings(monkeypatch: pytest.MonkeyPatch, small_wins_up_to: int, also_loses: int = 0) -> list[int]:
    """_pass_ms answers: the small kernel 1 ms up to `small_wins_up_to` tokens (but 3 ms at
    `also_loses`: a disturbed pass), else 3 ms; the GEMM 2 ms. Returns the token counts measured."""
    seen: list[int] = []

    def pass_ms(layers, inputs, fn) -> float:  # noqa: ANN001 - the measured function's signature
        n = next(iter(inputs.values())).shape[0]
        if fn is cpu_tuning._gemm:
            return 2.0
        seen.append(n)
        return 1.0 if n <= small_wins_up_to and n != also_loses else 3.0

    monkeypatch.setattr(cpu_tuning, "_pass_ms", pass_ms)
    return seen


def test_overrides_are_checked() -> None:
    assert parse_overrides(None) == {} and parse_overrides('{"wq_max_tokens": 4}') == {"wq_max_tokens": 4}
    for text, says in [
        ("{", "not JSON"),
        ("[4]", "JSON object"),
        ('{"wq": 4}', "unknown bound"),
        ('{"wq_max_tokens": 0}', "1 to 256"),
        ('{"f16_max_tokens": true}', "1 to 256"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_overrides(text)


def test_server_args_refuse_a_bad_mode_or_override() -> None:
    with pytest.raises(ValueError, match="cpu-kernel-tuning"):
        ServerArgs(device="cpu", cpu_kernel_tuning="fast").resolve()
    with pytest.raises(ValueError, match="unknown bound"):
        ServerArgs(device="cpu", cpu_kernel_crossovers='{"nope": 3}').resolve()


@needs_onednn
def test_measurement_picks_the_last_size_the_small_kernel_wins_and_is_cached(monkeypatch) -> None:
    layers = _layers()
    seen = _fake_timings(monkeypatch, small_wins_up_to=6)
    chosen = resolve_crossovers("auto", None, layers, world_size=1)
    assert chosen.wq_max_tokens == 6
    assert seen[-2:] == [8, 12]  # it stopped once the GEMM won twice in a row
    # The fp32 small-M bound has no layer to measure here (every layer is weight-only): default.
    assert chosen.f32_small_max_tokens == DEFAULTS.f32_small_max_tokens
    cached = json.loads(cache_path(layers).read_text())
    assert cached["bounds"]["wq_max_tokens"] == 6 and cached["cpu"]["threads"] == torch.get_num_threads()

    # Deterministic given the cache: a second start reads it and measures nothing.
    monkeypatch.setattr(cpu_tuning, "measure", lambda layers: pytest.fail("measured again"))
    again = resolve_crossovers("auto", None, layers, world_size=1)
    assert again.bounds() == chosen.bounds() and "cached" in again.source


@needs_onednn
def test_one_disturbed_pass_does_not_cut_the_bound(monkeypatch) -> None:
    _fake_timings(monkeypatch, small_wins_up_to=8, also_loses=4)
    assert resolve_crossovers("measure", None, _layers(), world_size=1).wq_max_tokens == 8


@needs_onednn
def test_the_cache_decides_and_measure_overwrites_it(monkeypatch) -> None:
    layers = _layers()
    path = cache_path(layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"bounds": {"wq_max_tokens": 3, "f32_small_max_tokens": 5, "f16_max_tokens": 12}})
    )
    real_measure = cpu_tuning.measure
    monkeypatch.setattr(cpu_tuning, "measure", lambda layers: pytest.fail("measured despite the cache"))
    assert resolve_crossovers("auto", None, layers, 1).bounds() == {
        "wq_max_tokens": 3,
        "f32_small_max_tokens": 5,
        "f16_max_tokens": 12,
        "wq_a8_max_tokens": 0,  # a cache from before that bound: not measured, off
        "wq_batch_a8_max_tokens": 0,  # nor this one: no bound
    }
    # Overrides apply on top of the cached bounds.
    assert resolve_crossovers("auto", '{"wq_max_tokens": 2}', layers, 1).wq_max_tokens == 2

    monkeypatch.setattr(cpu_tuning, "measure", real_measure)
    _fake_timings(monkeypatch, small_wins_up_to=12)
    assert resolve_crossovers("measure", None, layers, 1).wq_max_tokens == 12
    assert json.loads(path.read_text())["bounds"]["wq_max_tokens"] == 12


@needs_onednn
def test_a_different_model_shape_has_its_own_cache_entry() -> None:
    a, b = _layers(), _layers()
    assert cache_path(a) == cache_path(b)  # same shapes and forms, other values: the same entry
    c = [Linear(64, 128, bias=False)]
    prepare_cpu_linears(c, fp16=False, prepack=True)
    assert cache_path(c) != cache_path(a)


@needs_onednn
def test_off_busy_and_multi_rank_serve_the_defaults(monkeypatch) -> None:
    layers = _layers()
    monkeypatch.setattr(cpu_tuning, "measure", lambda layers: pytest.fail("measured"))
    assert resolve_crossovers("off", None, layers, 1).bounds() == DEFAULTS.bounds()
    assert resolve_crossovers("off", '{"f16_max_tokens": 8}', layers, 1).f16_max_tokens == 8
    assert resolve_crossovers("auto", None, layers, 2).bounds() == DEFAULTS.bounds()
    monkeypatch.setattr(cpu_tuning, "machine_busy", lambda: "machine busy (load 5.0 on 2 CPUs)")
    busy = resolve_crossovers("auto", None, layers, 1)
    assert busy.bounds() == DEFAULTS.bounds() and "busy" in busy.source
    assert not cache_path(layers).exists()  # a busy machine's measurement is never cached


@needs_onednn
def test_linear_follows_the_installed_bound(monkeypatch) -> None:
    (layer, _) = _layers()
    calls: list[int] = []
    real = linear_module.linear_wq
    monkeypatch.setattr(linear_module, "linear_wq", lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b))
    x4 = torch.randn(4, 64)
    install(Crossovers(wq_max_tokens=8))
    want = layer(x4)
    install(Crossovers(wq_max_tokens=2))
    got = layer(x4)  # 4 tokens now take the GEMM over the exact fp32 dequantization
    assert calls == [4]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_model_runner_installs_the_overrides_and_the_fused_decode_follows(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    args = ServerArgs(
        model_path=path,
        max_total_tokens=4096,
        device="cpu",
        cpu_kernel_tuning="off",
        cpu_kernel_crossovers='{"f32_small_max_tokens": 4}',
    ).resolve()
    worker = TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))
    assert active().f32_small_max_tokens == 4 and "overrides" in active().source
    fused = worker.model_runner.cpu_decode_runner
    if fused is not None:  # sgl-kernel built: its batch bound is the installed one
        assert fused.max_bs == 4


def test_machine_busy_sees_a_neighbour_now_and_a_high_load_average(monkeypatch) -> None:
    monkeypatch.setattr(cpu_tuning, "available_cpus", lambda: 2)
    monkeypatch.setattr(cpu_tuning.os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    monkeypatch.setattr(cpu_tuning, "busy_cpus_now", lambda: 1.0)  # a neighbour that just started
    machine_busy = REAL_MACHINE_BUSY
    assert "1.0 of 2 CPUs busy" in machine_busy()
    monkeypatch.setattr(cpu_tuning, "busy_cpus_now", lambda: 0.1)
    assert machine_busy() == ""
    monkeypatch.setattr(cpu_tuning.os, "getloadavg", lambda: (1.8, 1.0, 0.5))  # still settling
    assert "load 1.8" in machine_busy()
    monkeypatch.setattr(cpu_tuning, "busy_cpus_now", lambda: None)  # /proc/stat unreadable
    assert "load 1.8" in machine_busy()
