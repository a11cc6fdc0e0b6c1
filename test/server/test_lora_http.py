"""LoRA over HTTP on a real server (tiny random Llama, adapters written with peft): lora_path on
/generate, OpenAI's model "base:adapter", /load_lora_adapter and /unload_lora_adapter with
SGLang's fields, /v1/models listing the adapters, an unload that waits for the adapter's running
request (which finishes whole), and every bad input a 400 naming the reason."""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_helpers import Server, assert_error, start_servers, wait_until  # noqa: E402

from radixserve.testing.tiny_lora import make_tiny_adapter  # noqa: E402
from radixserve.testing.tiny_models import hf_greedy  # noqa: E402

pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 99, 120, 33, 7, 250]
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_llama_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_http")
    return {
        n: str(make_tiny_adapter(tiny_llama_path, n, root / n, seed=i))
        for i, n in enumerate(("attn8", "mlp4"))
    }


@pytest.fixture(scope="module")
def server(tiny_llama_path: str, adapters: dict[str, str]):
    flags = ["--max-total-tokens", "4096", "--served-model-name", "tiny"]
    flags += ["--lora-paths", f"attn8={adapters['attn8']}", "--max-lora-rank", "8"]
    flags += ["--lora-target-modules", "all"]
    started = start_servers({"s": Server.real(tiny_llama_path, *flags)})["s"]
    yield started
    started.stop()


def _post(server: Server, route: str, body: Any = None) -> httpx.Response:  # noqa: ANN401
    return httpx.post(f"{server.url}{route}", json=body, timeout=120)


def _generate(server: Server, **extra: Any) -> httpx.Response:
    return _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, **extra})


def _peft_tokens(base: str, adapter: str | None, n: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return hf_greedy(model.eval(), PROMPT, n)[0]


def test_generate_with_adapter_matches_peft(server: Server, tiny_llama_path: str, adapters: dict) -> None:
    resp = _generate(server, lora_path="attn8")
    assert resp.status_code == 200, resp.text
    assert resp.json()["output_ids"] == _peft_tokens(tiny_llama_path, adapters["attn8"], 6)
    base = _generate(server)
    assert base.json()["output_ids"] == _peft_tokens(tiny_llama_path, None, 6)
    # A batch mixing the adapter and the base model, one lora_path per prompt.
    both = _post(
        server,
        "/generate",
        {"input_ids": [PROMPT, PROMPT], "sampling_params": GREEDY, "lora_path": ["attn8", None]},
    )
    assert [o["output_ids"] for o in both.json()] == [resp.json()["output_ids"], base.json()["output_ids"]]


def test_bad_lora_input_is_a_400_naming_it(server: Server, tiny_llama_path: str, tmp_path) -> None:
    assert "nope" in assert_error(_generate(server, lora_path="nope"), 400)["message"]
    assert (
        "nope"
        in assert_error(
            _post(server, "/v1/completions", {"model": "tiny:nope", "prompt": PROMPT, "max_tokens": 2}), 400
        )["message"]
    )
    assert_error(_post(server, "/v1/completions", {"model": "other:attn8", "prompt": PROMPT}), 404)
    # A rank above --max-lora-rank 8 (all16 is rank 16), a corrupt file, a folder that is no adapter.
    big = make_tiny_adapter(tiny_llama_path, "all16", tmp_path / "all16")
    out = _post(server, "/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
    assert out.status_code == 400 and "--max-lora-rank 8" in out.json()["error_message"]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 4, "target_modules": ["q_proj"]})
    )
    (corrupt / "adapter_model.safetensors").write_bytes(b"\0garbage")
    out = _post(server, "/load_lora_adapter", {"lora_name": "bad", "lora_path": str(corrupt)})
    assert out.status_code == 400 and "corrupt" in out.json()["error_message"]
    out = _post(server, "/load_lora_adapter", {"lora_name": "none", "lora_path": str(tmp_path)})
    assert out.status_code == 400 and "adapter_config.json" in out.json()["error_message"]
    assert _post(server, "/unload_lora_adapter", {"lora_name": "nope"}).status_code == 400
    assert _generate(server, lora_path="attn8").status_code == 200  # the server kept running


def test_load_list_use_and_unload_while_running(server: Server, tiny_llama_path: str, adapters: dict) -> None:
    out = _post(server, "/load_lora_adapter", {"lora_name": "mlp4", "lora_path": adapters["mlp4"]})
    assert out.status_code == 200, out.text
    assert out.json()["success"] and set(out.json()["loaded_adapters"]) == {"attn8", "mlp4"}
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["tiny", "attn8", "mlp4"]
    assert models[2]["parent"] == "tiny" and models[2]["root"] == adapters["mlp4"]
    chat = _post(
        server, "/v1/completions", {"model": "tiny:mlp4", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["text"]

    # A long request on mlp4 runs while mlp4 is unloaded: the unload waits for it, it finishes whole.
    long_params = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    result: dict[str, httpx.Response] = {}
    body = {"input_ids": PROMPT, "sampling_params": long_params, "lora_path": "mlp4", "rid": "long-mlp4"}
    worker = threading.Thread(target=lambda: result.setdefault("r", _post(server, "/generate", body)))
    worker.start()
    wait_until(lambda: _running(server) > 0, 60, "the mlp4 request to run")
    out = _post(server, "/unload_lora_adapter", {"lora_name": "mlp4"})
    worker.join(timeout=120)
    assert out.status_code == 200 and out.json()["loaded_adapters"] == {"attn8": adapters["attn8"]}
    assert result["r"].status_code == 200 and len(result["r"].json()["output_ids"]) == 200
    assert "mlp4" in assert_error(_generate(server, lora_path="mlp4"), 400)["message"]
    # Loaded again under the same name: served again, with the same tokens as before.
    assert (
        _post(server, "/load_lora_adapter", {"lora_name": "mlp4", "lora_path": adapters["mlp4"]}).status_code
        == 200
    )
    assert _generate(server, lora_path="mlp4").json()["output_ids"] == _peft_tokens(
        tiny_llama_path, adapters["mlp4"], 6
    )


def _running(server: Server) -> int:
    return int(httpx.get(f"{server.url}/get_load", timeout=30).json()[0].get("num_reqs", 0))
