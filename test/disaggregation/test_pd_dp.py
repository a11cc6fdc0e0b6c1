"""Real prefill and decode servers (tiny model, 127.0.0.1) with --dp-size 2 on one side, driven as
a PD load balancer drives them (each request to both halves with the same bootstrap_room), against
a colocated server: prefill DP 2 + decode DP 1 and prefill DP 1 + decode DP 2, requests placed by the room (follow_bootstrap_room) and pinned as the SGLang Model Gateway
pins them (routed_dp_rank to each half, disagg_prefill_dp_rank to the decode half); every replica
serves some, and every replica's pool is full afterwards. A request naming a prefill replica that
does not exist gets a 400. Every wait is bounded and every process started here is stopped."""

from __future__ import annotations

import itertools
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))
from real_helpers import random_ids, state_is_full  # noqa: E402
from server_helpers import Server, start_servers, wait_until  # noqa: E402

from radixserve.utils.network import get_free_port  # noqa: E402

# Five servers (seven scheduler processes) start in the fixture: a hang ends the test, not the run.
# make test-all only (docs/testing.md): slow and covered in make test by the parts it combines
pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow]

POOL = "8192"
_rooms = itertools.count(7000)


class PDServer(Server):
    def __init__(self, model: str, mode: str, dp: int, bootstrap_port: int | None = None) -> None:
        flags = ["--max-total-tokens", POOL, "--chunked-prefill-size", "128"]
        flags += ["--dp-size", str(dp), "--disaggregation-mode", mode]
        if bootstrap_port is not None:
            flags += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        self.bootstrap_port = bootstrap_port
        super().__init__(["-m", "radixserve.launch_server", "--model-path", model, *flags])


@pytest.fixture(scope="module")
def servers(tiny_llama_path):
    made = {
        "p2": PDServer(tiny_llama_path, "prefill", 2, get_free_port()),
        "d1": PDServer(tiny_llama_path, "decode", 1),
        "p1": PDServer(tiny_llama_path, "prefill", 1, get_free_port()),
        "d2": PDServer(tiny_llama_path, "decode", 2),
        "c1": Server.real(tiny_llama_path, "--max-total-tokens", POOL),
    }
    try:
        yield start_servers(made, timeout=900)  # this 2-core machine is shared: start-up can be slow
    finally:
        for server in made.values():
            server.stop()


def replica_states(server: Server) -> list[dict[str, Any]]:
    return httpx.get(f"{server.url}/get_server_info", timeout=30).json()["internal_states"]


def all_idle_and_full(server: Server) -> bool:
    return all(
        state_is_full(s)
        and s.get("num_bootstrap_queue_reqs", 0) + s.get("num_inflight_queue_reqs", 0) == 0
        and s.get("num_prealloc_queue_reqs", 0) + s.get("num_transfer_queue_reqs", 0) == 0
        for s in replica_states(server)
    )


def assert_full(*servers: Server) -> None:
    for server in servers:
        wait_until(lambda s=server: all_idle_and_full(s), 30, f"{server.url}'s replicas' pools back to full")


def pd_post(
    prefill: PDServer,
    decode: Server,
    body: dict,
    room: int,
    prefill_extra: dict | None = None,
    decode_extra: dict | None = None,
    route: str = "/generate",
) -> tuple[httpx.Response, httpx.Response]:
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(httpx.post, f"{s.url}{route}", json={**body, **pd, **(extra or {})}, timeout=120)
            for s, extra in ((prefill, prefill_extra), (decode, decode_extra))
        ]
        return futures[0].result(), futures[1].result()


PROMPTS = [random_ids(11, 6), random_ids(12, 100), random_ids(13, 300), random_ids(14, 17)]


def greedy(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}


def expected(colocated: Server) -> list[list[int]]:
    return [
        httpx.post(f"{colocated.url}/generate", json=greedy(ids), timeout=120).json()["output_ids"]
        for ids in PROMPTS
    ]


def test_prefill_dp2_decode_dp1(servers):
    """Rooms alternate between the prefill replicas (room % 2); then each request pinned to the
    replica its room does not imply, as the Gateway pins a DP-aware prefill worker's requests."""
    p, d = servers["p2"], servers["d1"]
    want = expected(servers["c1"])
    before = [s["kv_transfers"] for s in replica_states(p)]
    for i in (0, 1, 2, 3, 1, 1):  # the repeats hit a replica's radix cache
        room = next(_rooms)
        got_p, got_d = pd_post(p, d, greedy(PROMPTS[i]), room)
        assert got_p.status_code == 200 and got_d.status_code == 200, (got_p.text, got_d.text)
        assert got_d.json()["output_ids"] == want[i], (room, got_p.json(), got_d.json())
    for i, ids in enumerate(PROMPTS):
        room = next(_rooms)
        rank = 1 - room % 2
        got_p, got_d = pd_post(
            p, d, greedy(ids), room, {"routed_dp_rank": rank}, {"disagg_prefill_dp_rank": rank}
        )
        assert got_d.status_code == 200, got_d.text
        assert got_d.json()["output_ids"] == want[i]
    # A load balancer that sends one body to both halves: the prefill server follows it too.
    room = next(_rooms)
    got_p, got_d = pd_post(p, d, greedy(PROMPTS[0]), room, *[{"disagg_prefill_dp_rank": 1 - room % 2}] * 2)
    assert got_d.status_code == 200 and got_d.json()["output_ids"] == want[0], got_d.text
    after = [s["kv_transfers"] for s in replica_states(p)]
    assert all(a - b >= 4 for a, b in zip(after, before)), (before, after)  # both replicas served
    assert_full(p, d)


def test_prefill_dp1_decode_dp2(servers):
    """The decode server's replicas take turns (round robin), then each is pinned (routed_dp_rank);
    each bootstraps with the prefill server on its own and runs its own queues."""
    p, d = servers["p1"], servers["d2"]
    want = expected(servers["c1"])
    before = [s["kv_transfer_bytes_received"] for s in replica_states(d)]
    for i, ids in enumerate(PROMPTS):
        got_p, got_d = pd_post(p, d, greedy(ids), next(_rooms))
        assert got_p.status_code == 200 and got_d.status_code == 200, (got_p.text, got_d.text)
        assert got_d.json()["output_ids"] == want[i]
    for rank in (0, 1):
        for i, ids in enumerate(PROMPTS[:2]):
            got_p, got_d = pd_post(p, d, greedy(ids), next(_rooms), decode_extra={"routed_dp_rank": rank})
            assert got_d.status_code == 200 and got_d.json()["output_ids"] == want[i], got_d.text
    after = [s["kv_transfer_bytes_received"] for s in replica_states(d)]
    assert all(a > b for a, b in zip(after, before)), (before, after)
    # The OpenAI routes carry the PD fields too.
    model = httpx.get(f"{servers['c1'].url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
    want_text = httpx.post(f"{servers['c1'].url}/v1/completions", json=body, timeout=120).json()
    got_p, got_d = pd_post(p, d, body, next(_rooms), None, {"routed_dp_rank": 1}, route="/v1/completions")
    assert got_d.status_code == 200, got_d.text
    assert got_d.json()["choices"][0]["text"] == want_text["choices"][0]["text"]
    assert_full(p, d)


def test_a_prefill_replica_that_does_not_exist_is_a_400(servers):
    p, d = servers["p2"], servers["d1"]
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": next(_rooms)}
    bad = {**greedy(PROMPTS[0]), **pd, "disagg_prefill_dp_rank": 5}
    got = httpx.post(f"{p.url}/generate", json=bad, timeout=60)  # the prefill server knows its replicas
    assert got.status_code == 400 and "disagg_prefill_dp_rank 5 is out of range" in got.text
    got = httpx.post(f"{p.url}/generate", json={**bad, "routed_dp_rank": 2}, timeout=60)
    assert got.status_code == 400 and "routed_dp_rank 2 is out of range" in got.text
    # The decode server learns the prefill server's replicas at bootstrap; its prefill half (placed
    # by the room) is told and ends too, instead of waiting out the bootstrap timeout.
    t0 = time.monotonic()
    got_p, got_d = pd_post(p, d, greedy(PROMPTS[0]), next(_rooms), None, {"disagg_prefill_dp_rank": 5})
    assert got_d.status_code == 400, got_d.text
    assert "disagg_prefill_dp_rank 5 is out of range" in got_d.json()["error"]["message"]
    assert "2 data-parallel replica(s)" in got_d.json()["error"]["message"]
    assert got_p.status_code != 200 or got_p.json()["meta_info"]["finish_reason"]["type"] == "abort", (
        got_p.text
    )
    assert "out of range" in got_p.text
    assert time.monotonic() - t0 < 60
    assert_full(p, d)
