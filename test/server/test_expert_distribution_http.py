"""SGLang's expert-distribution routes on a real server with a tiny random Qwen3-MoE (top-8 of 16
experts): start (GET, as SGLang's clients may call it), generate, stop (POST), dump -> SGLang's
.pt file with every decoded token's choices and the prompt's; a second dump holds no pass."""

from __future__ import annotations

import os
import re
import sys

import httpx
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_helpers import Server, start_servers  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 99, 120, 33, 7, 250]
NEW = 5


def test_record_generate_dump(tiny_model_dir, tmp_path) -> None:
    flags = ["--max-total-tokens", "4096", "--expert-distribution-recorder-mode", "stat"]
    argv = ["-m", "radixserve.launch_server", "--model-path", tiny_model_dir("qwen3_moe"), *flags]
    server = Server(argv, env={"SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": str(tmp_path)})
    start_servers({"moe": server})
    try:
        resp = httpx.get(f"{server.url}/start_expert_distribution_record", timeout=60)
        assert resp.status_code == 200 and resp.text == "Start recording the expert distribution.\n"
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        }
        assert httpx.post(f"{server.url}/generate", json=body, timeout=120).status_code == 200
        resp = httpx.post(f"{server.url}/stop_expert_distribution_record", timeout=60)
        assert resp.status_code == 200 and resp.text == "Stop recording the expert distribution.\n"
        resp = httpx.post(f"{server.url}/dump_expert_distribution_record", timeout=60)
        assert resp.status_code == 200 and resp.text.startswith("Dump expert distribution record.")
        path = re.search(r"Written to (\S+\.pt)\.", resp.text).group(1)
        assert os.path.dirname(path) == str(tmp_path)
        counts = torch.load(path, weights_only=True)["logical_count"]
        # One prefill row, then a decode row per token but the last; 2 layers, 16 experts, top-8.
        assert counts.shape == (NEW, 2, 16)
        assert counts.sum(-1).tolist() == [[len(PROMPT) * 8] * 2] + [[8, 8]] * (NEW - 1)
        resp = httpx.post(f"{server.url}/dump_expert_distribution_record", timeout=60)
        again = re.search(r"Written to (\S+\.pt)\.", resp.text).group(1)
        assert torch.load(again, weights_only=True)["logical_count"].shape[0] == 0
    finally:
        server.stop()
