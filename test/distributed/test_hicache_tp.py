"""HiCache at --tp-size 2 through the Engine (gloo on 127.0.0.1). Each rank keeps its shard's KV
in its own host tier and its own L3 directory; the ranks agree, once per scheduling round, on the
L3 pages every one of them has read (HiRadixStorageCache._agree), so they build the same tree and
admit the same requests. Checked: prompts whose documents exceed the device pool give the same
greedy tokens when loaded back from L2, from L3 after a restart, and after a restart in which only
rank 1's page files are corrupt (rank 0's are intact, yet no rank serves a page from L3: the
ranks take the least that any of them read)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.configs.hicache_args import STORAGE_DIR_ENV
from radixserve.mem_cache.hicache_storage import SUFFIX
from radixserve.testing.tiny_models import TINY_VOCAB

PAGE = 16
DOCS, DOC_LEN = 6, 150  # 9 whole pages each; the device pool holds about two documents
PAGES = DOCS * (DOC_LEN // PAGE)
PARAMS = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(DOC_LEN)] for _ in range(DOCS)]


def _engine(path: str) -> Engine:
    return Engine(
        model_path=path, tp_size=2, page_size=PAGE, max_total_tokens=384, max_running_requests=2,
        enable_hierarchical_cache=True, hicache_ratio=4, hicache_storage_backend="file",
        hicache_storage_prefetch_policy="wait_complete", log_level="warning",
    )  # fmt: skip


def _run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """One prompt at a time: each one's prefix was evicted by the ones after it on a first pass."""
    return [engine.generate(input_ids=p, sampling_params=PARAMS)["output_ids"] for p in prompts]


def _rank_files(root: Path) -> list[list[Path]]:
    return [sorted((root / f"tp{r}-of-2").glob(f"*{SUFFIX}")) for r in range(2)]


def _wait_written(root: Path, timeout: float = 120) -> list[list[Path]]:
    """Both ranks' backups on disk (written by a thread each, after the requests ended)."""
    deadline = time.monotonic() + timeout
    while True:
        files = _rank_files(root)
        if all(len(f) >= PAGES for f in files):
            return files
        assert time.monotonic() < deadline, f"page files per rank: {[len(f) for f in files]}"
        time.sleep(0.1)


@pytest.mark.timeout(900)
def test_tiers_at_tp2_give_the_same_tokens_and_ranks_agree_on_l3(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(STORAGE_DIR_ENV, str(tmp_path))
    path, prompts = tiny_model_dir("llama"), _prompts()
    with _engine(path) as engine:
        cold = _run(engine, prompts)  # nothing cached: every token computed
        again = _run(engine, prompts)  # the pool evicted the early documents: loaded from L2
        tiers = engine.get_internal_state()["hicache"]
        assert again == cold
        assert tiers["host_hit_tokens"] >= 2 * DOC_LEN, tiers
        files = _wait_written(tmp_path)
    assert [len(f) for f in files] == [PAGES, PAGES]  # each rank wrote its own shard of every page

    with _engine(path) as engine:  # a restart: L1 and L2 empty, L3 on disk
        assert _run(engine, prompts) == cold
        hits = engine.get_internal_state()["hicache"]["storage_hit_tokens"]
        assert hits >= DOCS * (DOC_LEN // PAGE - 1) * PAGE, hits

    for f in _rank_files(tmp_path)[1]:  # flip the last payload byte of every rank-1 page
        blob = bytearray(f.read_bytes())
        blob[-1] ^= 0xFF
        f.write_bytes(bytes(blob))
    with _engine(path) as engine:
        assert _run(engine, prompts) == cold
        tiers = engine.get_internal_state()["hicache"]
        # Rank 0 (reporting) read its intact pages, but rank 1 read none: nothing was taken.
        assert tiers["storage_hit_tokens"] == 0 and tiers["storage_read_tokens"] > 0, tiers
    assert all(os.path.exists(f) for f in _rank_files(tmp_path)[0])
