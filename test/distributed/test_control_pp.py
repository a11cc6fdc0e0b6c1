"""The control plane on a pipeline-parallel server (--pp-size 2: two scheduler processes, stage 0
holding the embedding and layer 0, stage 1 layer 1, the final norm and the head), over HTTP:
flush_cache empties both stages' KV, update_weights_from_disk and update_weights_from_tensor
load each stage's part (and a bad checkpoint leaves both on the old weights),
get_weights_by_name reads a weight from whichever stage holds it, and release / resume frees and
restores both stages. Tiny random qwen2 (tied embeddings: the head is a copy on stage 1)."""

from __future__ import annotations

import os
import sys
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))
from server_helpers import Server, assert_error, start_servers  # noqa: E402

from radixserve.testing.tiny_models import hf_greedy, make_tiny_model  # noqa: E402

pytestmark = pytest.mark.timeout(600)

PROMPT = [9, 88, 140, 23, 200, 71, 5, 301, 12, 40, 41, 42]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("pp_weights")
    paths = {
        "a": make_tiny_model("qwen2", root / "a", seed=0),
        "b": make_tiny_model("qwen2", root / "b", seed=1),
        "llama": make_tiny_model("llama", root / "llama", seed=2),
    }
    hf = {k: AutoModelForCausalLM.from_pretrained(paths[k], dtype=torch.float32).eval() for k in ("a", "b")}
    return {"paths": {k: str(v) for k, v in paths.items()}, "hf": hf}


@pytest.fixture(scope="module")
def pp2(models: dict[str, Any]):
    started = start_servers(
        {"pp2": Server.real(models["paths"]["a"], "--pp-size", "2", "--max-total-tokens", "4096")}
    )
    yield started["pp2"]
    started["pp2"].stop()


def _post(server: Server, route: str, body: Any = None) -> httpx.Response:  # noqa: ANN401
    return httpx.post(f"{server.url}{route}", json=body, timeout=300)


def _generate(server: Server) -> dict[str, Any]:
    resp = _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _weights(server: Server, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        resp = _post(server, "/get_weights_by_name", {"name": name, "truncate_size": 10**6})
        assert resp.status_code == 200, (name, resp.text)
        out[name] = torch.tensor(resp.json())
    return out


def _states(server: Server) -> list[dict[str, Any]]:
    """Each rank's (stage's) KV pool report."""
    return httpx.get(f"{server.url}/get_server_info", timeout=30).json()["internal_states"][0]["ranks"]


@pytest.fixture
def on_a(pp2: Server, models: dict[str, Any]) -> dict[str, Any]:
    """Each test starts from checkpoint A (loaded from disk: what a resume reloads)."""
    resp = _post(
        pp2, "/update_weights_from_disk", {"model_path": models["paths"]["a"], "weight_version": "a"}
    )
    assert resp.status_code == 200, resp.text
    hf_a, hf_b = models["hf"]["a"], models["hf"]["b"]
    return {"a": hf_greedy(hf_a, PROMPT, 8)[0], "b": hf_greedy(hf_b, PROMPT, 8)[0]}


def test_get_weights_by_name_reads_each_stage(pp2: Server, models: dict[str, Any], on_a: dict) -> None:
    assert _generate(pp2)["output_ids"] == on_a["a"]
    # Every checkpoint weight, from the stage that holds it (the tied head from either).
    sd_a = models["hf"]["a"].state_dict()
    for name, value in _weights(pp2, list(sd_a)).items():
        assert torch.equal(value, sd_a[name]), name
    cut = _post(pp2, "/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 3}).json()
    assert torch.equal(torch.tensor(cut), sd_a["lm_head.weight"][:3])
    assert_error(_post(pp2, "/get_weights_by_name", {"name": "model.layers.5.mlp.up_proj.weight"}), 400)
    assert_error(_post(pp2, "/get_weights_by_name", {"name": "model.layers.1.mlp.nope.weight"}), 400)


def test_flush_cache_empties_both_stages(pp2: Server, on_a: dict) -> None:
    _generate(pp2)
    assert _generate(pp2)["meta_info"]["cached_tokens"] > 0
    assert all(r["evictable_tokens"] > 0 for r in _states(pp2))
    assert _post(pp2, "/flush_cache").status_code == 200
    assert all(r["evictable_tokens"] == 0 for r in _states(pp2))
    assert _generate(pp2)["meta_info"]["cached_tokens"] == 0


def test_update_weights_from_disk_and_tensor_on_both_stages(
    pp2: Server, models: dict[str, Any], on_a: dict
) -> None:
    _generate(pp2)
    # From disk: each stage loads its layers; the cache is flushed on both.
    resp = _post(
        pp2, "/update_weights_from_disk", {"model_path": models["paths"]["b"], "weight_version": "b"}
    )
    assert resp.status_code == 200, resp.text
    assert all(r["evictable_tokens"] == 0 for r in _states(pp2))
    out = _generate(pp2)
    assert out["output_ids"] == on_a["b"] and out["meta_info"]["weight_version"] == "b"
    sd_a, sd_b = models["hf"]["a"].state_dict(), models["hf"]["b"].state_dict()
    layer1 = "model.layers.1.self_attn.v_proj.weight"  # stage 1's
    assert torch.equal(_weights(pp2, [layer1])[layer1], sd_b[layer1])

    # Refused (another architecture): both stages keep B.
    resp = _post(pp2, "/update_weights_from_disk", {"model_path": models["paths"]["llama"]})
    assert resp.status_code == 400 and "LlamaForCausalLM" in resp.json()["message"]
    assert _generate(pp2)["output_ids"] == on_a["b"]

    # From tensors: a subset of A's weights (stage 1's only), then all of them.
    from radixserve.model_executor.tensor_payload import serialize_named_tensors

    stage1 = [(n, t) for n, t in sd_a.items() if n.startswith("model.layers.1.")]
    body = {"serialized_named_tensors": [serialize_named_tensors(stage1)]}
    assert _post(pp2, "/update_weights_from_tensor", body).status_code == 200
    assert torch.equal(_weights(pp2, [layer1])[layer1], sd_a[layer1])
    body = {"serialized_named_tensors": [serialize_named_tensors(list(sd_a.items()))]}
    assert _post(pp2, "/update_weights_from_tensor", body).status_code == 200
    assert _generate(pp2)["output_ids"] == on_a["a"]


def test_release_and_resume_memory_on_both_stages(pp2: Server, models: dict[str, Any], on_a: dict) -> None:
    # Weights set from tensors since the last disk load are not what a resume brings back.
    from radixserve.model_executor.tensor_payload import serialize_named_tensors

    sd_b = models["hf"]["b"].state_dict()
    body = {"serialized_named_tensors": [serialize_named_tensors(list(sd_b.items()))], "weight_version": "t"}
    assert _post(pp2, "/update_weights_from_tensor", body).status_code == 200
    assert _generate(pp2)["output_ids"] == on_a["b"]

    resp = _post(pp2, "/release_memory_occupation")
    assert resp.status_code == 200, resp.text
    state = httpx.get(f"{pp2.url}/get_server_info", timeout=30).json()["internal_states"][0]
    assert state["memory_released"] == ["kv_cache", "weights"]
    assert_error(_post(pp2, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}), 503)
    assert_error(_post(pp2, "/get_weights_by_name", {"name": "model.layers.1.mlp.up_proj.weight"}), 400)
    resp = _post(pp2, "/resume_memory_occupation")
    assert resp.status_code == 200 and models["paths"]["a"] in resp.json()["message"], resp.text
    out = _generate(pp2)
    assert out["output_ids"] == on_a["a"] and out["meta_info"]["weight_version"] == "a"
    assert all(r["memory_leak"] is None for r in _states(pp2))
