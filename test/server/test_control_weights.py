"""Weight updates for RL through the Engine on tiny random Llamas (A, then a second checkpoint B):
greedy outputs equal HF's for the checkpoint loaded, the prefix cache is flushed, bad updates are
refused with the old weights kept, in-flight requests finish on the old weights (or are aborted),
and a trainer process broadcasts new weights over a gloo group (update_weights_from_distributed)."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from real_helpers import engine_leak_check

from radixserve import Engine
from radixserve.testing.tiny_models import hf_greedy, make_tiny_model
from radixserve.utils.network import get_free_port

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 99, 120, 33, 7, 250, 61, 3, 44]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("weights")
    paths = {
        name: make_tiny_model(kind, root / name, seed)
        for name, kind, seed in (
            ("a", "llama", 0),
            ("b", "llama", 1),
            ("qwen3", "qwen3", 2),
        )
    }
    # B without one tensor: a checkpoint that misses a weight.
    from safetensors.torch import load_file, save_file

    missing = root / "missing"
    shutil.copytree(paths["b"], missing)
    (weights_file,) = missing.glob("*.safetensors")
    tensors = load_file(weights_file)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, weights_file, metadata={"format": "pt"})
    hf = {k: AutoModelForCausalLM.from_pretrained(paths[k], dtype=torch.float32).eval() for k in ("a", "b")}
    return {"paths": {**{k: str(v) for k, v in paths.items()}, "missing": str(missing)}, "hf": hf}


@pytest.fixture(scope="module")
def shared_engine(ckpts: dict[str, Any]):
    with Engine(model_path=ckpts["paths"]["a"], max_total_tokens=4096, log_level="warning") as e:
        yield e


@pytest.fixture
def engine(shared_engine: Engine, ckpts: dict[str, Any]) -> Engine:
    """One Engine for the module (a start-up each cost ~6 s), handed to each test as a fresh one
    would be: checkpoint A, weight_version "default", nothing cached, no slow-down."""
    shared_engine.slow_down(None)
    ok, message = shared_engine.update_weights_from_disk(ckpts["paths"]["a"], weight_version="default")
    assert ok, message
    state = shared_engine.get_internal_state()
    assert state["weight_version"] == "default" and state["evictable_tokens"] == 0, state
    assert state["num_running_reqs"] == 0, state
    return shared_engine


def _greedy(engine: Engine, prompt: list[int] = PROMPT, **kw: Any) -> dict:
    return engine.generate(input_ids=prompt, sampling_params=GREEDY, **kw)


def test_update_from_disk_follows_the_new_checkpoint_and_flushes_the_cache(
    engine: Engine, ckpts: dict[str, Any]
) -> None:
    hf_a, hf_b = ckpts["hf"]["a"], ckpts["hf"]["b"]
    first = _greedy(engine)
    assert first["output_ids"] == hf_greedy(hf_a, PROMPT, 8)[0]
    assert first["meta_info"]["weight_version"] == "default"
    assert _greedy(engine)["meta_info"]["cached_tokens"] == len(PROMPT) - 1  # the prompt is cached

    ok, message = engine.update_weights_from_disk(ckpts["paths"]["b"], weight_version="v2")
    assert ok, message
    assert "Cache flushed" in message
    assert engine.get_internal_state()["evictable_tokens"] == 0  # nothing cached any more
    out = _greedy(engine)
    assert out["meta_info"]["cached_tokens"] == 0  # the old weights' KV is not reused
    assert out["output_ids"] == hf_greedy(hf_b, PROMPT, 8)[0] != first["output_ids"]
    assert out["meta_info"]["weight_version"] == "v2"
    assert engine.get_internal_state()["weight_version"] == "v2"

    # flush_cache=False keeps the prefix cache (stale KV: the caller's choice).
    ok, _ = engine.update_weights_from_disk(ckpts["paths"]["a"], flush_cache=False)
    assert ok
    assert _greedy(engine)["meta_info"]["cached_tokens"] == len(PROMPT) - 1


def test_bad_updates_are_refused_and_the_old_weights_kept(engine: Engine, ckpts: dict[str, Any]) -> None:
    expected = hf_greedy(ckpts["hf"]["a"], PROMPT, 8)[0]
    paths = ckpts["paths"]
    refusals = [
        (engine.update_weights_from_disk(paths["qwen3"]), "Qwen3ForCausalLM"),  # wrong architecture
        (engine.update_weights_from_disk(paths["missing"]), "missing"),  # a tensor is missing
        (engine.update_weights_from_disk("/nonexistent/checkpoint"), "Cannot read"),
        (engine.update_weights_from_disk(paths["b"], load_format="gguf"), "load_format"),
        (
            engine.update_weights_from_tensor(
                [("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 3))]
            ),
            "Shape mismatch",
        ),
        (
            engine.update_weights_from_tensor([("model.norm.weight", torch.ones(64, dtype=torch.int32))]),
            "dtype",
        ),
        (engine.update_weights_from_tensor([("model.no_such.weight", torch.zeros(2))]), "no weight named"),
    ]
    for (ok, message), needle in refusals:
        assert not ok and needle in message, message
        assert _greedy(engine)["output_ids"] == expected
    # A partly valid update (the first tensor fits, the second does not) changes nothing either.
    sd = ckpts["hf"]["b"].state_dict()
    ok, message = engine.update_weights_from_tensor(
        [
            ("model.embed_tokens.weight", sd["model.embed_tokens.weight"]),
            ("lm_head.weight", torch.zeros(5, 64)),
        ]
    )
    assert not ok and "previous weights are kept" in message
    assert _greedy(engine)["output_ids"] == expected
    assert engine.get_internal_state()["weight_version"] == "default"


def test_update_from_tensor_and_get_weights_by_name(engine: Engine, ckpts: dict[str, Any]) -> None:
    sd = ckpts["hf"]["b"].state_dict()
    ok, message = engine.update_weights_from_tensor(list(sd.items()), weight_version="tensor-1")
    assert ok, message
    assert _greedy(engine)["output_ids"] == hf_greedy(ckpts["hf"]["b"], PROMPT, 8)[0]
    assert _greedy(engine)["meta_info"]["weight_version"] == "tensor-1"
    # Checkpoint names, including the ones fused into qkv_proj and gate_up_proj.
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        got = torch.tensor(engine.get_weights_by_name(name, truncate_size=5))
        assert torch.allclose(got, sd[name][:5]), name
    assert len(engine.get_weights_by_name("model.embed_tokens.weight")) == 100  # truncate_size default
    with pytest.raises(ValueError, match="no weight named"):
        engine.get_weights_by_name("model.layers.7.mlp.up_proj.weight")


def test_in_flight_requests_finish_on_the_old_weights_or_are_aborted(
    engine: Engine, ckpts: dict[str, Any]
) -> None:
    hf_a = ckpts["hf"]["a"]
    long = {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}
    results: dict[str, Any] = {}

    def run(key: str) -> None:
        results[key] = engine.generate(input_ids=PROMPT, sampling_params=long)

    # Each forward sleeps 20 ms: the request is still running when the update arrives, however
    # fast the machine (120 tiny-model tokens otherwise finish between two polls).
    engine.slow_down(0.02)
    thread = threading.Thread(target=run, args=("old",))
    thread.start()
    _wait_running(engine)
    ok, _ = engine.update_weights_from_disk(ckpts["paths"]["b"])
    thread.join()
    assert ok
    assert results["old"]["output_ids"] == hf_greedy(hf_a, PROMPT, 120)[0]  # all on A
    assert _greedy(engine)["output_ids"] == hf_greedy(ckpts["hf"]["b"], PROMPT, 8)[0]

    thread = threading.Thread(target=run, args=("aborted",))
    thread.start()
    _wait_running(engine)
    ok, _ = engine.update_weights_from_disk(ckpts["paths"]["a"], abort_all_requests=True)
    thread.join()
    engine.slow_down(None)
    assert ok
    meta = results["aborted"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 120
    assert _greedy(engine)["output_ids"] == hf_greedy(hf_a, PROMPT, 8)[0]


def _wait_running(engine: Engine) -> None:
    import time

    deadline = time.monotonic() + 30
    while engine.get_internal_state()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)


# ------------------------------------------------------------------ the trainer over gloo
def _trainer(path: str, port: int, world_size: int, ready: Any) -> None:  # noqa: ANN401
    """Rank 0 of the weight group: broadcast every tensor of checkpoint `path`, in file order."""
    from safetensors.torch import load_file

    from radixserve.model_executor.weight_group import init_weights_group

    (weights_file,) = Path(path).glob("*.safetensors")
    tensors = load_file(weights_file)
    group = init_weights_group("127.0.0.1", port, 0, world_size, "trainer_group", "gloo")
    ready.set()
    for name in sorted(tensors):
        group.broadcast(tensors[name].contiguous(), 0).wait()


def test_a_trainer_broadcasts_new_weights(engine: Engine, ckpts: dict[str, Any]) -> None:
    from safetensors import safe_open

    path_b = ckpts["paths"]["b"]
    (weights_file,) = Path(path_b).glob("*.safetensors")
    with safe_open(weights_file, "pt") as f:
        names = sorted(f.keys())
        meta = [(str(f.get_slice(n).get_dtype()), list(f.get_slice(n).get_shape())) for n in names]
    dtypes = [{"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[d] for d, _ in meta]
    shapes = [s for _, s in meta]

    port = get_free_port()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    trainer = ctx.Process(target=_trainer, args=(path_b, port, 2, ready), daemon=True)
    trainer.start()
    try:
        ok, message = engine.init_weights_update_group("127.0.0.1", port, 1, 2, "trainer_group", "gloo")
        assert ok, message
        assert ready.wait(60)
        ok, message = engine.update_weights_from_distributed(
            names, dtypes, shapes, "trainer_group", weight_version="step-1"
        )
        assert ok, message
        trainer.join(60)
        assert trainer.exitcode == 0
        out = _greedy(engine)
        assert out["output_ids"] == hf_greedy(ckpts["hf"]["b"], PROMPT, 8)[0]
        assert out["meta_info"]["weight_version"] == "step-1"
        assert engine.update_weights_from_distributed(names[:1], dtypes[:1], shapes[:1], "nope")[0] is False
        assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, "trainer_group", "gloo")[0] is False
        assert engine.destroy_weights_update_group("trainer_group") == (
            True,
            "Succeeded to destroy the weight update group.",
        )
        assert engine.destroy_weights_update_group("trainer_group")[0] is False
    finally:
        if trainer.is_alive():
            trainer.kill()
        trainer.join(5)


def test_collective_rpc_reaches_the_scheduler(engine: Engine) -> None:
    from radixserve.entrypoints.rpc_client import RpcError

    state = engine.collective_rpc("get_internal_state")
    assert state["weight_version"] == "default" and state["num_running_reqs"] == 0
    assert engine_leak_check(engine) is None
    with pytest.raises(RpcError, match="Unknown RPC method"):
        engine.collective_rpc("os.system")
