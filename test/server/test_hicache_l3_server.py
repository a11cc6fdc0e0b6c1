"""The real server with HiCache's L3 tier: pages written to the directory of
SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, counted in /get_server_info and /metrics, kept by
/flush_cache, and served to a restarted server (a fresh process over the same directory)."""

from __future__ import annotations

import re

import httpx
from real_helpers import generate, internal_state, random_ids
from server_helpers import Server, start_servers, wait_until

FLAGS = (
    "--enable-metrics",
    "--max-total-tokens",
    "2048",
    "--page-size",
    "16",
    "--enable-hierarchical-cache",
    "--hicache-storage-backend",
    "file",
    "--hicache-storage-prefetch-policy",
    "wait_complete",
)


def start(model: str, directory: str) -> Server:
    server = Server(
        ["-m", "radixserve.launch_server", "--model-path", model, *FLAGS],
        env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": directory},
    )
    start_servers({"l3": server})
    return server


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(rf'^sglang:{name}{{model_name="[^"]*"}} (\S+)$', text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_a_restarted_server_answers_from_disk(tiny_llama_path, tmp_path):
    ids = random_ids(41, 200)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
    server = start(tiny_llama_path, str(tmp_path))
    try:
        first = generate(server.url, **body)
        tiers = wait_until(
            lambda: (t := internal_state(server.url)["hicache"])["storage_written_pages"] >= 12 and t,
            60,
            "the backup thread to write the prompt's pages",
        )
        assert tiers["storage_dir"] == str(tmp_path) and tiers["storage_files"] >= 12
        assert metric(server.url, "backuped_tokens_total") >= 12 * 16
        assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
        assert internal_state(server.url)["hicache"]["storage_files"] == tiers["storage_files"]
    finally:
        server.stop()
    server = start(tiny_llama_path, str(tmp_path))
    try:
        again = generate(server.url, **body)
        assert again["output_ids"] == first["output_ids"]
        assert again["meta_info"]["cached_tokens"] >= 12 * 16
        tiers = internal_state(server.url)["hicache"]
        assert tiers["storage_hit_tokens"] >= 12 * 16 and tiers["storage_corrupt_files"] == 0
        assert metric(server.url, "prefetched_tokens_total") >= 12 * 16
    finally:
        server.stop()
