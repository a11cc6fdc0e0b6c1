"""/update_weights_from_tensor with SGLang's payload, sent by a separate process on the same host (this
test plays the RL trainer; the server is launch_server's process tree): tensors serialized as
SGLang's MultiprocessingSerializer.serialize(named_tensors, output_str=True) does (ForkingPickler
with torch's reductions, then base64; re-implemented here, sglang is not a dependency), as a list
of pairs, a flattened bucket and load_format 'direct'. Greedy outputs follow the new weights.

CPU tensors travel as shared-memory handles: with torch's 'file_system' sharing strategy any
process of the host can open them; with the default 'file_descriptor' only a process holding the
sender's multiprocessing authkey can, so the server refuses them with a 400 that says so."""

from __future__ import annotations

import base64
import io
import os
import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any

import httpx
import pytest
import torch
import torch.multiprocessing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_helpers import Server  # noqa: E402

from radixserve.testing.tiny_models import hf_greedy, make_tiny_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 99, 120, 33, 7, 250]
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def sglang_serialize(obj: object) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True)."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


@contextmanager
def sharing_strategy(name: str) -> Iterator[None]:
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(name)
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


@pytest.fixture
def server(control_server: Server) -> Server:
    """conftest's server shared with the other control-route file, back on the tiny model's weights."""
    return control_server


def _post(server: Server, route: str, body: Any) -> httpx.Response:  # noqa: ANN401
    return httpx.post(f"{server.url}{route}", json=body, timeout=120)


def _greedy(server: Server) -> list[int]:
    resp = _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def _flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's FlattenedTensorBucket payload, its metadata pickled under SGLang's class name."""
    from radixserve.model_executor.tensor_payload import FlattenedTensorMetadata

    flats, metadata, at = [], [], 0
    for name, t in named:
        flat = t.detach().contiguous().flatten().view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, at, at + flat.numel(), flat.numel()))
        flats.append(flat)
        at += flat.numel()
    return {"flattened_tensor": torch.cat(flats), "metadata": metadata}


def test_sglang_serialized_tensors_update_a_running_server(
    server: Server, tiny_llama_path: str, tmp_path
) -> None:
    from transformers import AutoModelForCausalLM

    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    hf_old, hf_new = load(tiny_llama_path), load(make_tiny_model("llama", tmp_path / "new", seed=11))
    want_old, want_new = hf_greedy(hf_old, PROMPT, 6)[0], hf_greedy(hf_new, PROMPT, 6)[0]
    assert _greedy(server) == want_old != want_new
    new = list(hf_new.state_dict().items())

    # The default strategy shares CPU tensors by file descriptor: not receivable by another
    # process tree. Refused with the fix in the message; the old weights keep serving.
    with sharing_strategy("file_descriptor"):
        resp = _post(
            server, "/update_weights_from_tensor", {"serialized_named_tensors": [sglang_serialize(new)]}
        )
    assert resp.status_code == 400 and "set_sharing_strategy('file_system')" in resp.json()["message"]
    assert _greedy(server) == want_old

    with sharing_strategy("file_system"):
        body = {"serialized_named_tensors": [sglang_serialize(new)], "weight_version": "sgl-1"}
        resp = _post(server, "/update_weights_from_tensor", body)
        assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
        out = _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()
        assert out["output_ids"] == want_new and out["meta_info"]["weight_version"] == "sgl-1"
        got = _post(server, "/get_weights_by_name", {"name": "model.layers.1.mlp.down_proj.weight"})
        assert torch.allclose(
            torch.tensor(got.json()), hf_new.state_dict()["model.layers.1.mlp.down_proj.weight"]
        )

        # load_format "flattened_bucket": the old model's tensors back to back in one buffer.
        bucket = _flattened_bucket(list(hf_old.state_dict().items()))
        body = {"serialized_named_tensors": [sglang_serialize(bucket)], "load_format": "flattened_bucket"}
        resp = _post(server, "/update_weights_from_tensor", body)
        assert resp.status_code == 200, resp.text
        assert _greedy(server) == want_old

        # load_format "direct": the server's own parameter names, copied as they are.
        norm = hf_new.state_dict()["model.norm.weight"]
        body = {
            "serialized_named_tensors": [sglang_serialize([("model.norm.weight", norm)])],
            "load_format": "direct",
        }
        assert _post(server, "/update_weights_from_tensor", body).status_code == 200
        got = _post(server, "/get_weights_by_name", {"name": "model.norm.weight"}).json()
        assert torch.allclose(torch.tensor(got), norm)
        q = hf_new.state_dict()["model.layers.0.self_attn.q_proj.weight"]
        body["serialized_named_tensors"] = [sglang_serialize([("model.layers.0.self_attn.q_proj.weight", q)])]
        resp = _post(server, "/update_weights_from_tensor", body)
        assert resp.status_code == 400 and "no parameter named" in resp.json()["message"]

    # Anything but tensors is refused before it runs.
    evil = base64.b64encode(pickle.dumps([("x", print)])).decode()
    resp = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
    assert resp.status_code == 400 and "builtins.print is not allowed" in resp.json()["message"]
    resp = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["aGVsbG8="]})
    assert resp.status_code == 400 and "MultiprocessingSerializer.serialize" in resp.json()["message"]
    resp = _post(
        server, "/update_weights_from_tensor", {"serialized_named_tensors": [evil], "load_format": "gguf"}
    )
    assert resp.status_code == 400 and "'flattened_bucket'" in resp.json()["message"]
