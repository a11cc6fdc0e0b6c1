"""HiCache's L3 tier (page files) over the real TpModelWorker (tiny llama): a restarted scheduler
with the same directory serves a repeated prompt from disk with the same greedy output; a
flipped byte, a truncated file and another model's file are never served."""

import random

import pytest
from scheduler_harness import SchedulerRun, WorkerCache

from radixserve.configs.hicache_args import STORAGE_DIR_ENV
from radixserve.managers.io_struct import AbortReq, GetInternalStateReq
from radixserve.mem_cache.hicache_storage import SUFFIX
from radixserve.testing.tiny_models import TINY_VOCAB
from radixserve.utils.hicache_metrics import render_hicache

POOL = 512
DOC = 160


def prompts(seed: int, n: int = 3) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    return [(f"p{i}", [rng.randrange(3, TINY_VOCAB) for _ in range(DOC + i)]) for i in range(n)]


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    return WorkerCache(tiny_model_dir)


@pytest.fixture
def l3_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(STORAGE_DIR_ENV, str(tmp_path))
    return tmp_path


def l3_args(**kw) -> dict:
    return dict(
        enable_hierarchical_cache=True,
        hicache_ratio=4,
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy="wait_complete",
        **kw,
    )


def serve(
    workers, page_size: int, reqs, kind: str = "llama", **overrides
) -> tuple[dict[str, list[int]], dict, dict[str, int]]:
    """One scheduler (a fresh tree: a "restart"), the requests one after another, then closed."""
    worker, args = workers.get(kind, page_size, POOL)
    run = SchedulerRun(worker, args, **overrides)
    try:
        for rid, ids in reqs:
            run.submit(rid, ids, 8)
            run.run_until_idle()
        tree = run.scheduler.mem.tree_cache
        if getattr(tree, "l3", None) is not None:
            tree.l3.drain()  # every backup written before the next "server" starts
        state = run.scheduler.get_internal_state(GetInternalStateReq()).internal_state
        run.close()
    finally:
        if not run.closed:
            run.force_clean()
    return run.outputs, state.get("hicache", {}), run.cached_tokens


def page_files(directory) -> list[str]:
    return sorted(str(p) for p in directory.iterdir() if p.name.endswith(SUFFIX))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunked", [64, -1], ids=["chunk64", "nochunk"])
def test_restart_serves_a_repeated_prompt_from_disk(workers, l3_dir, page_size, chunked):
    reqs = prompts(1)
    base, _, _ = serve(workers, page_size, reqs, chunked_prefill_size=chunked)
    first, tiers, _ = serve(workers, page_size, reqs, chunked_prefill_size=chunked, **l3_args())
    assert first == base
    assert tiers["storage_written_pages"] > 0 and page_files(l3_dir), tiers
    # A new scheduler, its tree empty: the prompts' pages come from L3.
    again, tiers, cached = serve(workers, page_size, reqs, chunked_prefill_size=chunked, **l3_args())
    assert again == base
    aligned = (DOC - 1) // page_size * page_size
    assert tiers["storage_hit_tokens"] >= len(reqs) * aligned, tiers
    assert all(cached[rid] >= aligned for rid, _ in reqs), cached
    assert tiers["storage_corrupt_files"] == 0
    text = render_hicache([{"dp_rank": 0, "hicache": tiers}])
    read = tiers["storage_hit_pages"] * page_size
    assert f"sglang:prefetched_tokens_total {read}\n" in text and read >= tiers["storage_hit_tokens"]
    assert "# TYPE sglang:hicache_storage_corrupt_files_total counter" in text


def damage(files: list[str], how: str) -> None:
    """Damage every page file, so the first page a lookup reads is bad whichever it is."""
    blobs = []
    for name in files:
        with open(name, "rb") as f:
            blobs.append(f.read())
    for i, name in enumerate(files):
        blob = bytearray(blobs[i])
        if how == "flipped":  # one payload bit
            blob[-5] ^= 0x40
        elif how == "truncated":  # a write cut short
            blob = blob[: len(blob) // 2]
        else:  # another page's file under this name
            blob = bytearray(blobs[(i + 1) % len(blobs)])
        with open(name, "wb") as f:
            f.write(blob)


@pytest.mark.parametrize("how", ["flipped", "truncated", "foreign"])
def test_damaged_files_are_detected_and_recomputed(workers, l3_dir, how):
    page_size = 16
    reqs = prompts(2, n=1)
    base, _, _ = serve(workers, page_size, reqs)
    serve(workers, page_size, reqs, **l3_args())
    files = page_files(l3_dir)
    assert len(files) >= 9
    damage(files, how)
    out, tiers, cached = serve(workers, page_size, reqs, **l3_args())
    assert out == base
    # The first page read is bad: it is deleted and counted, and the pages after it are not read
    # (a prefix is contiguous), so the whole prompt is computed.
    assert tiers["storage_corrupt_files"] == 1, tiers
    assert tiers["storage_hit_tokens"] == 0 and cached["p0"] == 0, (tiers, cached)


def test_another_models_pages_are_not_found(workers, l3_dir):
    """Same tokens, same directory, same KV shape and page size, another checkpoint (tiny qwen2:
    another config.json and weight files): its keys differ, so nothing is read, let alone served;
    the llama's own pages are still found."""
    reqs = prompts(3, n=1)
    serve(workers, 16, reqs, **l3_args())
    _, tiers, _ = serve(workers, 16, reqs, kind="qwen2", **l3_args())
    assert tiers["storage_hit_pages"] == 0 and tiers["storage_hit_tokens"] == 0, tiers
    _, tiers, _ = serve(workers, 16, reqs, **l3_args())
    assert tiers["storage_hit_tokens"] > 0, tiers


def test_aborts_during_prefetch_leak_no_slot(workers, l3_dir):
    """Mixed load with aborts while requests wait for their prefetch: the closing leak checks
    (L1, L2 and request rows) pass, and the survivors' outputs are the baseline's."""
    page_size = 16
    reqs = prompts(4, n=4)
    base, _, _ = serve(workers, page_size, reqs)
    serve(workers, page_size, reqs, **l3_args())
    worker, args = workers.get("llama", page_size, POOL)
    run = SchedulerRun(worker, args, max_running_requests=2, **l3_args())
    try:
        for rid, ids in reqs:
            run.submit(rid, ids, 8)
        run.step()  # their prefetches start (two requests are held: at most two run)
        run.scheduler.process_input_requests([AbortReq(rid="p1"), AbortReq(rid="p3")])
        run.run_until_idle()
        assert run.scheduler.mem.tree_cache.check_invariants() >= 0
        run.close()
    finally:
        if not run.closed:
            run.force_clean()
    assert run.outputs.get("p0") == base["p0"] and run.outputs.get("p2") == base["p2"]
