"""Fixtures of the real-model server and Engine tests: shared Engines and servers (the model
folders, tiny_llama_path and builtin_model_path, are test/conftest.py's).

The Engines are session-scoped so that test_engine_real.py and test_server_real.py (which
compares the HTTP server against the Engine) share one start-up per model.
"""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_scheduler import write_tiny_tokenizer  # noqa: E402
from real_helpers import BUILTIN_SERVER_POOL_TOKENS  # noqa: E402
from server_helpers import (  # noqa: E402
    BUILTIN_POOL_TOKENS,
    FAKE_API_KEY,
    FIELDS_CHUNK,
    TINY_POOL_TOKENS,
    Server,
    SharedServers,
    start_servers,
)

CONTROL_POOL_TOKENS = "4096"


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_path: str):
    from radixserve import Engine

    with Engine(model_path=tiny_llama_path, max_total_tokens=TINY_POOL_TOKENS) as engine:
        yield engine


@pytest.fixture(scope="session")
def fields_engine(tiny_llama_path: str):
    """The tiny model in small chunks, with the request fields that need a flag allowed
    (return_hidden_states, custom_logit_processor): test_hidden_states.py, test_request_fields.py,
    test_token_ids_logprob.py."""
    from radixserve import Engine

    with Engine(
        model_path=tiny_llama_path,
        max_total_tokens=4096,
        chunked_prefill_size=FIELDS_CHUNK,
        enable_return_hidden_states=True,
        enable_custom_logit_processor=True,
        custom_logit_processor_modules=("radixserve.testing.logit_processors",),
    ) as engine:
        yield engine


@pytest.fixture(scope="session")
def fields_overlap_engine(tiny_llama_path: str):
    """fields_engine with the overlap loop (the CPU default is the normal one)."""
    from radixserve import Engine

    with Engine(
        model_path=tiny_llama_path,
        max_total_tokens=4096,
        chunked_prefill_size=FIELDS_CHUNK,
        enable_return_hidden_states=True,
        enable_overlap_schedule=True,
    ) as engine:
        yield engine


@pytest.fixture(params=["normal", "overlap"])
def fields_engines(request: pytest.FixtureRequest):
    """The request-field Engines of both loops, one after the other."""
    return request.getfixturevalue("fields_engine" if request.param == "normal" else "fields_overlap_engine")


@pytest.fixture(scope="session")
def builtin_engine(builtin_model_path: str):
    from radixserve import Engine

    with Engine(model_path=builtin_model_path, max_total_tokens=BUILTIN_POOL_TOKENS) as engine:
        yield engine


@pytest.fixture(scope="session")
def builtin_tokenizer(builtin_model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_model_path)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_path)


# Real servers, started together once for the session and shared by test_server_real*.py.
@pytest.fixture(scope="session")
def servers(tiny_llama_path: str, builtin_model_path: str) -> dict[str, Server]:
    started = {
        "tiny": Server.real(
            tiny_llama_path,
            "--enable-metrics",
            "--max-total-tokens",
            str(TINY_POOL_TOKENS),
        ),
        "builtin": Server.real(builtin_model_path, "--max-total-tokens", str(BUILTIN_SERVER_POOL_TOKENS)),
        "limited": Server.real(
            tiny_llama_path,
            "--max-queued-requests",
            "1",
            "--max-running-requests",
            "1",
            "--max-total-tokens",
            "4096",
        ),
    }
    try:
        yield start_servers(started)
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="session")
def tiny(servers: dict[str, Server]) -> str:
    return servers["tiny"].url


@pytest.fixture(scope="session")
def builtin(servers: dict[str, Server]) -> str:
    return servers["builtin"].url


@pytest.fixture(scope="session")
def hf_tiny(tiny_llama_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_builtin(builtin_model_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(builtin_model_path, dtype=torch.float32).eval()


# The other client families' tests (test_anthropic_api.py, test_ollama_api.py,
# test_responses_api.py) talk to the session's built-in-model server: one start-up fewer.
@pytest.fixture(scope="session")
def client_apis_url(servers: dict[str, Server]) -> str:
    return servers["builtin"].url


# The control-route tests (test_control_http.py, test_control_sglang_tensors.py) share one server:
# each test gets it back on the tiny model's own weights (weight_version "default", cache flushed).
@pytest.fixture(scope="session")
def _control_server(tiny_llama_path: str):
    started = start_servers({"s": Server.real(tiny_llama_path, "--max-total-tokens", CONTROL_POOL_TOKENS)})[
        "s"
    ]
    yield started
    started.stop()


@pytest.fixture
def control_server(_control_server: Server, tiny_llama_path: str) -> Server:
    body = {"model_path": tiny_llama_path, "weight_version": "default"}
    resp = httpx.post(f"{_control_server.url}/update_weights_from_disk", json=body, timeout=120)
    assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
    return _control_server


# Fake-scheduler servers shared by test_http_fake.py and test_http_errors_fake.py ("auth"); a test
# that ends one (test_http_fake's lifecycle tests) leaves the next user a fresh start.
@pytest.fixture(scope="session")
def fake_servers(tmp_path_factory: pytest.TempPathFactory):
    tok_dir = str(tmp_path_factory.mktemp("fake_tok"))
    write_tiny_tokenizer(tok_dir)
    main_flags = ("--enable-metrics", "--max-queued-requests", "4", "--served-model-name", "tiny")
    shared = SharedServers(
        {
            "main": lambda: Server.fake(tok_dir, *main_flags),
            "auth": lambda: Server.fake(tok_dir, "--api-key", FAKE_API_KEY),
            # The detokenizer process's route, beside main's default (inline on CPU):
            # test_http_fake.py runs its text tests on both.
            "process": lambda: Server.fake(tok_dir, "--detokenizer", "process", *main_flags),
        }
    )
    try:
        yield shared
    finally:
        shared.stop()


# The tiny Qwen2.5-VL and its server, shared by test_vlm_server.py and test_vlm_openai.py: the media
# flags are test_vlm_openai's (test_vlm_server sends data: URLs only, and a URL from a host not
# allowed is refused with or without --allowed-media-domains).
@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from radixserve.testing.tiny_vlm import make_tiny_qwen2_5_vl

    return str(make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="session")
def vlm_local_media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """--allowed-local-media-path: allowed/cat.png inside it, secret.png beside it (outside)."""
    from radixserve.testing.tiny_vlm import image_data_url, random_image

    png = base64.b64decode(image_data_url(random_image(84, 56, seed=1)).partition(",")[2])
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "cat.png").write_bytes(png)
    (root / "secret.png").write_bytes(png)
    return root / "allowed"


@pytest.fixture(scope="session")
def vlm_server(vlm_dir: str, vlm_local_media: Path):
    flags = ("--max-total-tokens", "2048", "--allowed-media-domains", "127.0.0.1")
    local = ("--allowed-local-media-path", str(vlm_local_media), "--media-fetch-timeout", "1")
    server = Server.real(vlm_dir, *flags, *local)
    try:
        yield start_servers({"vlm": server})["vlm"]
    finally:
        server.stop()
