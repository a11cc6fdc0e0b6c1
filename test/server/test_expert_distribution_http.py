"""SGLang's expert-distribution routes on a real server with a tiny random Qwen3-MoE (top-8 of 16
experts): start (GET, as SGLang's clients may call it), generate, stop (POST), dump -> SGLang's
.pt file with every decoded token's choices and the prompt's; a second dump holds no pass."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator

import httpx
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_helpers import Server, start_servers  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 99, 120, 33, 7, 250]
NEW = 5


@pytest.fixture(scope="module")
def moe(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    """One server for both tests (one start fewer): the recorder records only between start and
    stop, and the metric test compares counts before and after its own requests."""
    dump_dir = str(tmp_path_factory.mktemp("expert_dumps"))
    flags = ["--max-total-tokens", "4096", "--expert-distribution-recorder-mode", "stat"]
    flags += ["--enable-metrics", "--enable-expert-distribution-metrics", "--served-model-name", "tiny-moe"]
    argv = ["-m", "radixserve.launch_server", "--model-path", tiny_model_dir("qwen3_moe"), *flags]
    server = Server(argv, env={"SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": dump_dir})
    start_servers({"moe": server})
    try:
        yield server, dump_dir
    finally:
        server.stop()


def test_record_generate_dump(moe: tuple[Server, str]) -> None:
    server, dump_dir = moe
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
    assert os.path.dirname(path) == dump_dir
    counts = torch.load(path, weights_only=True)["logical_count"]
    # One prefill row, then a decode row per token but the last; 2 layers, 16 experts, top-8.
    assert counts.shape == (NEW, 2, 16)
    assert counts.sum(-1).tolist() == [[len(PROMPT) * 8] * 2] + [[8, 8]] * (NEW - 1)
    resp = httpx.post(f"{server.url}/dump_expert_distribution_record", timeout=60)
    again = re.search(r"Written to (\S+\.pt)\.", resp.text).group(1)
    assert torch.load(again, weights_only=True)["logical_count"].shape[0] == 0


def _expert_counts(url: str) -> dict[tuple[int, int], int]:
    """sglang:moe_expert_tokens_total's samples by (layer, expert), checking their model_name."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    pattern = r'^sglang:moe_expert_tokens_total\{model_name="([^"]*)",layer="(\d+)",expert="(\d+)"\} (\d+)$'
    counts = {}
    for name, layer, expert, value in re.findall(pattern, text, flags=re.M):
        assert name == "tiny-moe"
        counts[(int(layer), int(expert))] = int(value)
    return counts


def test_expert_load_metric_counts_every_routed_token(moe: tuple[Server, str]) -> None:
    server, _ = moe
    # The server is shared: the other test's prompt (PROMPT) would otherwise hit the radix cache.
    assert httpx.post(f"{server.url}/flush_cache", timeout=60).status_code == 200
    before = _expert_counts(server.url)  # a start-up warm-up may have run already
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]  # no shared prefix: no cache hit
    for prompt in prompts:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        }
        assert httpx.post(f"{server.url}/generate", json=body, timeout=120).status_code == 200
    after = _expert_counts(server.url)
    assert {layer for layer, _ in after} == {0, 1} and len(after) == 2 * 16  # 2 layers x 16 experts
    added = {key: after[key] - before.get(key, 0) for key in after}
    assert all(v >= 0 for v in added.values())
    # Each forwarded token (the prompt's, then every generated one but the last) chose top-8
    # experts in each of the 2 MoE layers.
    tokens = sum(len(p) + NEW - 1 for p in prompts)
    for layer in (0, 1):
        assert sum(v for (lay, _), v in added.items() if lay == layer) == tokens * 8
