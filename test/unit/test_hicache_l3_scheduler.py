"""The scheduler with the L3 tier over a FakeWorker whose "KV" (the token id at each slot) lives in
a real pool, so pages read from disk with wrong bytes change the outputs. The prefetch thread's
reads are gated by an Event, so "the prefetch is still running" is a state the test holds, not a
race: wait_complete holds the request, timeout and best_effort admit it without the pages, and
a prefetch whose request was aborted or admitted is cancelled without leaking a slot."""

from __future__ import annotations

import threading

import pytest
from fake_worker import reference_output
from test_hicache_scheduler import TieredFakeWorker

from radixserve.configs.hicache_args import STORAGE_DIR_ENV
from radixserve.managers.io_struct import AbortReq, GetInternalStateReq
from radixserve.mem_cache import hiradix_storage_cache
from radixserve.mem_cache.hicache_storage import FileStorage

DOC = 96


def doc(seed: int) -> list[int]:
    return [(seed * 131 + i * 7) % 997 for i in range(DOC)]


def start(make_harness, page_size: int = 16, max_running_requests: int = 2, **args):
    return make_harness(
        worker=TieredFakeWorker(max_total_num_tokens=320, page_size=page_size),
        page_size=page_size,
        max_running_requests=max_running_requests,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        **args,
    )


def tiers(h) -> dict:
    h.step([GetInternalStateReq()])
    return h.sent[-1].internal_state["hicache"]


def warm(make_harness, page_size: int, docs: list[int]) -> None:
    """A first "server" writes the documents' pages to L3."""
    h = start(make_harness, page_size)
    for d in docs:
        h.submit(f"w{d}", doc(d) + [1], 4)
    h.run_until_idle()
    h.scheduler.mem.tree_cache.l3.drain()
    assert tiers(h)["storage_written_pages"] >= len(docs) * (DOC // page_size)


@pytest.fixture
def gate(tmp_path, monkeypatch):
    """L3 in tmp_path; reads block until gate.set()."""
    monkeypatch.setenv(STORAGE_DIR_ENV, str(tmp_path))
    event = threading.Event()
    read = FileStorage.get

    def gated(self, key, shape, dtype):
        assert event.wait(60), "the test never opened the gate"
        return read(self, key, shape, dtype)

    monkeypatch.setattr(FileStorage, "get", gated)
    event.set()  # open while warming
    return event


@pytest.mark.parametrize("page_size", [1, 16])
def test_wait_complete_holds_the_request_until_its_pages_are_in(make_harness, gate, page_size):
    warm(make_harness, page_size, [1])
    gate.clear()
    h = start(make_harness, page_size, hicache_storage_prefetch_policy="wait_complete")
    ids = doc(1) + [5, 6]
    h.submit("r", ids, 4)
    h.submit("other", doc(2) + [5], 4)  # nothing on disk: runs meanwhile
    for _ in range(20):
        h.step()
    assert "r" not in h.outputs and len(h.outputs.get("other", [])) == 4
    gate.set()
    h.run_until_idle()
    assert h.outputs["r"] == reference_output(ids, 4)
    t = tiers(h)
    assert t["storage_hit_tokens"] == DOC // page_size * page_size, t  # the document, from disk
    assert h.scheduler.mem.check_leak() is None


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_best_effort_and_timeout_admit_without_the_pages_and_cancel_cleanly(
    make_harness, gate, monkeypatch, policy
):
    monkeypatch.setattr(hiradix_storage_cache, "PREFETCH_TIMEOUT_BASE_S", 0.0)
    monkeypatch.setattr(hiradix_storage_cache, "PREFETCH_TIMEOUT_PER_KI_TOKEN_S", 0.0)
    warm(make_harness, 16, [1, 3])
    gate.clear()
    h = start(make_harness, 16, max_running_requests=1, hicache_storage_prefetch_policy=policy)
    ids = doc(1) + [5, 6]
    h.submit("r", ids, 4)
    h.submit("gone", doc(3) + [7], 4)
    h.step()  # both prefetches start; "r" is admitted at once, "gone" waits for a running slot
    assert len(h.scheduler.mem.tree_cache._ops) == 2
    h.step([AbortReq(rid="gone")])
    h.run_until_idle()  # the gate is still closed: "r" ran on computed KV
    assert h.outputs["r"] == reference_output(ids, 4)
    assert tiers(h)["storage_hit_tokens"] == 0
    gate.set()  # the cancelled reads finish now; their pages are never taken
    h.scheduler.mem.tree_cache.l3.drain()
    h.step()
    assert tiers(h)["storage_hit_tokens"] == 0
    assert h.scheduler.mem.check_leak() is None


def test_pages_from_before_a_weight_update_are_not_matched(make_harness, gate):
    warm(make_harness, 16, [1])
    h = start(make_harness, 16, hicache_storage_prefetch_policy="wait_complete")
    h.scheduler.mem.tree_cache.weights_updated()  # what a successful weight update calls
    ids = doc(1) + [5, 6]
    h.submit("r", ids, 4)
    h.run_until_idle()
    assert h.outputs["r"] == reference_output(ids, 4)
    assert tiers(h)["storage_hit_tokens"] == 0
