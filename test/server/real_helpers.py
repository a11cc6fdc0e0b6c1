"""Shared constants and helpers of the real-server tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import httpx
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from radixserve.testing.tiny_models import TINY_VOCAB  # noqa: E402

CAPITAL_Q = [{"role": "user", "content": "What is the capital of France?"}]
# Long generations run on the built-in model (~30 ms a token here: minutes for 2000 tokens); the
# tiny model decodes ~1000 tokens a second and has 1024 positions.
LONG = {"max_new_tokens": 2000, "ignore_eos": True}
TINY_LONG = {"max_new_tokens": 1000, "ignore_eos": True}
BUILTIN_SERVER_POOL_TOKENS = 40000  # room for 16 LONG requests at once


def random_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def internal_state(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]


def pool_is_full(url: str) -> bool:
    """No request left and every KV slot free or merely cached (evictable)."""
    return state_is_full(internal_state(url))


def state_is_full(s: dict[str, Any]) -> bool:
    """pool_is_full on an internal state already read."""
    return (
        s["num_running_reqs"] == 0
        and s["num_waiting_reqs"] == 0
        and s["available_tokens"] + s["evictable_tokens"] == s["max_total_num_tokens"]
    )


def generate(url: str, **body: Any) -> Any:
    resp = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """What the server feeds the model for a chat: the templated text, without extra BOS."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def until_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, tok in enumerate(ids):
        if tok in eos:
            return ids[:i]
    return ids


def engine_leak_check(engine: Any, timeout_s: float = 10.0) -> str | None:
    """The scheduler's check_memory_leak once it is idle. A response reaches the caller before the
    scheduler's next loop pass retires the finished request, so an immediate check may find it
    still alive; poll until the scheduler says something other than 'not idle'."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        answer = engine.collective_rpc("check_memory_leak")
        if answer is None or "not idle" not in answer or time.monotonic() > deadline:
            return answer
        time.sleep(0.05)
