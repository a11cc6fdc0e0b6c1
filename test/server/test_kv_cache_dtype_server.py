"""A real server with --kv-cache-dtype int8 serves /generate and reports its pool; values that
cannot work are refused at start with a message (an exit, not a server that fails later)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_helpers import generate, random_ids  # noqa: E402
from server_helpers import Server, start_servers  # noqa: E402


@pytest.fixture(scope="module")
def int8_server(tiny_llama_path: str):
    server = Server.real(tiny_llama_path, "--kv-cache-dtype", "int8", "--max-total-tokens", "2048")
    try:
        yield start_servers({"int8": server})["int8"].url
    finally:
        server.stop()


def test_int8_kv_serves_generate(int8_server: str):
    out = generate(
        int8_server,
        input_ids=random_ids(7, 40),
        sampling_params={"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True},
    )
    assert len(out["output_ids"]) == 12
    again = generate(  # the same prompt again: a radix hit over int8 KV, the same greedy tokens
        int8_server,
        input_ids=random_ids(7, 40),
        sampling_params={"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True},
    )
    assert again["output_ids"] == out["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0
    info = httpx.get(f"{int8_server}/get_server_info", timeout=30).json()
    assert info["kv_cache_dtype"] == "int8" and info["max_total_num_tokens"] == 2048


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-cache-dtype", "fp16"], "invalid choice"),
        (
            ["--kv-cache-dtype", "int8", "--attention-backend", "triton"],
            "--attention-backend cpu or torch_native",
        ),
    ],
)
def test_bad_kv_cache_dtype_is_refused_at_start(tiny_llama_path: str, flags: list[str], message: str):
    cmd = [
        sys.executable,
        "-m",
        "radixserve.launch_server",
        "--model-path",
        tiny_llama_path,
        "--port",
        "1",
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr
