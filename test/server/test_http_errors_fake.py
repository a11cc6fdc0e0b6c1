"""Issue 46 (items 2, 8a-c) end to end, over ZMQ with the fake scheduler and --api-key: a deeply
nested json_schema / regex is a 400 in the JSON envelope naming the limit (it was a plain-text
500), an out-of-range seed is a 400 stating the range, `authorization: bearer KEY` in any case is
accepted, and an output cut inside a UTF-8 character drops its bytes (no U+FFFD) and says so in
the finish reason, streamed or not."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fake_scheduler import write_tiny_tokenizer  # noqa: E402
from server_helpers import FAKE_API_KEY, SharedServers, assert_error, sse_events  # noqa: E402

pytestmark = pytest.mark.timeout(300)

KEY = FAKE_API_KEY
AUTH = {"authorization": f"bearer {KEY}"}  # lower-case scheme, as the tester's client sent it
DEEP_SCHEMA = '{"type":"object","properties":{"a":' * 1000 + '{"type":"string"}' + "}}" * 1000


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("errors") / "tok")
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def url(fake_servers: SharedServers) -> str:
    """conftest's shared fake server with an API key (test_http_fake.py's "auth")."""
    return fake_servers.get("auth")["auth"].url


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=30)


def test_auth_scheme_is_case_insensitive(url: str) -> None:
    for value in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer   {KEY}"):
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": value}).status_code == 200, value
    assert_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "bearer nope"}), 401)


def test_deep_json_schema_is_a_400_envelope(url: str) -> None:
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "json_schema": DEEP_SCHEMA}}
    err = assert_error(post(url, "/generate", body), 400)
    assert "json_schema: nested deeper than the limit of 128 levels" in err["message"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "json_schema": DEEP_SCHEMA}
    assert "limit of 128" in assert_error(post(url, "/v1/chat/completions", chat), 400)["message"]
    regex = {"text": "Hi", "sampling_params": {"regex": "(" * 2000 + "a" + ")" * 2000}}
    assert (
        "regex: nested deeper than the limit of 64"
        in assert_error(post(url, "/generate", regex), 400)["message"]
    )
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("seed", [2**63, 2**64 + 1, -1])
def test_out_of_range_seed_is_a_400_with_the_range(url: str, seed: int) -> None:
    native = {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "seed": seed}}
    err = assert_error(post(url, "/generate", native), 400)
    assert f"seed must be in [0, {2**63 - 1}], got {seed}." in err["message"]
    openai_body = {"prompt": "Hi", "max_tokens": 2, "seed": seed}
    assert "seed must be in [0, " in assert_error(post(url, "/v1/completions", openai_body), 400)["message"]
    assert post(
        url, "/generate", {**native, "sampling_params": {"max_new_tokens": 2, "seed": 2**63 - 1}}
    ).is_success


def test_output_cut_inside_a_character(url: str, tok_dir: str) -> None:
    """The fake "generates" its prompt: a prompt of the emoji's byte tokens, cut one short."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    emoji = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1 and tokenizer.decode(emoji) == "😀"
    body = {"input_ids": emoji, "sampling_params": {"max_new_tokens": len(emoji) - 1}}
    whole = post(url, "/generate", body).json()
    events = [json.loads(e) for e in sse_events(post(url, "/generate", {**body, "stream": True}))[:-1]]
    assert whole["text"] == "" and all(e["text"] == "" for e in events)  # cumulative text, no U+FFFD
    reason = whole["meta_info"]["finish_reason"]
    assert reason == {"type": "length", "length": len(emoji) - 1, "partial_char_dropped": True}
    assert events[-1]["meta_info"]["finish_reason"] == reason
    full = post(url, "/generate", {**body, "sampling_params": {"max_new_tokens": len(emoji)}}).json()
    assert full["text"] == "😀" and "partial_char_dropped" not in full["meta_info"]["finish_reason"]
