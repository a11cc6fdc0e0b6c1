"""HiCache on the prefill side of a disaggregated pair (both schedulers in this process, real TCP
transfer): documents that exceed the prefill side's device pool are loaded back from its host tier,
and after a "restart" (a new pair, the same L3 directory) from its page files, before the KV goes
to the decode side; the decode side's tokens equal one colocated scheduler's, and neither side
leaks a slot in any tier."""

from __future__ import annotations

import random

import pytest

from radixserve.configs.hicache_args import STORAGE_DIR_ENV
from radixserve.testing.inprocess import InProcessScheduler
from radixserve.testing.pd_pair import PDPair

PAGE, DOC_LEN, DOCS = 16, 150, 6
PREFILL = dict(
    enable_hierarchical_cache=True, hicache_ratio=4, max_total_tokens=384,
    hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
)  # fmt: skip


def _requests() -> list[tuple[str, list[int]]]:
    """Three turns over six documents, each turn with a new question after its document."""
    rng = random.Random(3)
    docs = [[rng.randrange(3, 250) for _ in range(DOC_LEN)] for _ in range(DOCS)]
    return [
        (f"d{d}t{t}", docs[d] + [rng.randrange(3, 250) for _ in range(6)])
        for t in range(3)
        for d in range(DOCS)
    ]


def _colocated(model: str, reqs: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
    ref = InProcessScheduler(model, disable_overlap_schedule=True, max_total_tokens=8192, page_size=PAGE)
    try:
        for rid, ids in reqs:
            ref.submit(rid, ids, max_new_tokens=6)
            ref.run_until_idle()
        return {rid: r.output_ids for rid, r in ref.results.items()}
    finally:
        ref.close()


def _serve(model: str, reqs: list[tuple[str, list[int]]]) -> tuple[dict[str, list[int]], dict]:
    """A new pair (an empty tree on both sides), the requests one after another."""
    pair = PDPair(model, prefill_args=PREFILL, decode_args={"max_total_tokens": 8192}, page_size=PAGE)
    try:
        for room, (rid, ids) in enumerate(reqs, start=1):
            pair.submit(rid, ids, room=room, max_new_tokens=6)
            pair.run_until_idle()
        tree = pair.prefill.scheduler.mem.tree_cache
        tree.l3.drain()  # every page on disk before the next pair starts
        assert pair.check_memory_leak() is None
        tree.check_invariants()
        return {rid: r.output_ids for rid, r in pair.decode.results.items()}, tree.tier_stats()
    finally:
        pair.close()


@pytest.mark.timeout(600)
def test_prefill_side_tiers_match_colocated(tiny_llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv(STORAGE_DIR_ENV, str(tmp_path))
    reqs = _requests()
    want = _colocated(tiny_llama_path, reqs)
    got, tiers = _serve(tiny_llama_path, reqs)
    assert got == want
    assert tiers["host_hit_tokens"] >= 2 * DOC_LEN and tiers["storage_written_pages"] > 0, tiers
    first_turn = reqs[:DOCS]
    got, tiers = _serve(tiny_llama_path, first_turn)  # a restart: only L3 holds the documents
    assert got == {rid: want[rid] for rid, _ in first_turn}
    assert tiers["storage_hit_tokens"] >= DOCS * (DOC_LEN // PAGE - 1) * PAGE, tiers
