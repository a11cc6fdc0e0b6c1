"""Data parallelism on either side of a prefill/decode pair, without a model: the bootstrap
server's replica table and room registry (SGLang's routes), the prefill server's replica choice
(follow_bootstrap_room, routed_dp_rank, disagg_prefill_dp_rank), and the real tcp backend finding
the prefill replica that holds a room (pinned, derived from the room, asked of the bootstrap
server), or failing a request that names a replica that does not exist."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import torch

from radixserve.disaggregation import wire
from radixserve.disaggregation.bootstrap_server import BootstrapServer, RoomRegistrar
from radixserve.disaggregation.heads import KVLayout
from radixserve.disaggregation.tcp_decode import DecodeTcpManager
from radixserve.disaggregation.tcp_prefill import PrefillTcpManager, ReplicaInfo
from radixserve.disaggregation.utils import KVPoll
from radixserve.managers.data_parallel_controller import DataParallelController
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.managers.io_struct import DisaggRouting, TokenizedGenerateReqInput
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs, resolve_load_balance_method
from radixserve.utils.network import PortArgs

LAYERS, HEADS, HEAD_DIM = 2, 2, 4


def _call(method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _reg(dp_rank: int, port: int, method: str = "round_robin") -> dict:
    return {
        "role": "Prefill",
        "rank_ip": "127.0.0.1",
        "rank_port": port,
        "engine_rank": 0,
        "tp_size": 1,
        "dp_size": 2,
        "system_dp_size": 2,
        "system_dp_rank": dp_rank,
        "load_balance_method": method,
        "page_size": 1,
        "kv_cache_dtype": "float32",
    }


def test_bootstrap_server_lists_each_replica_and_the_rooms_they_hold():
    server = BootstrapServer("127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.port}"
    layout_url = f"{base}/route?engine_rank=-1&target_dp_group=-1"
    try:
        assert _call("PUT", f"{base}/route", _reg(1, 2001)) == (200, "OK")
        status, text = _call("GET", layout_url)
        assert status == 503 and "not fully registered" in text  # replica 0 is still missing
        assert _call("PUT", f"{base}/route", _reg(0, 2000)) == (200, "OK")
        status, body = _call("GET", layout_url)
        info = json.loads(body)
        assert status == 200 and (info["dp_size"], info["tp_size"]) == (2, 1)
        assert info["follow_bootstrap_room"] is False  # round_robin: decode servers must ask
        for url in (
            f"{base}/route?engine_rank=0&target_dp_group=1",
            # SGLang's newer argument names
            f"{base}/route?prefill_dp_rank=1&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
        ):
            status, body = _call("GET", url)
            assert status == 200 and json.loads(body)["rank_port"] == 2001
        newer_layout = (
            f"{base}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        )
        assert json.loads(_call("GET", newer_layout)[1]) == info
        assert _call("GET", f"{base}/route?engine_rank=0&target_dp_group=2")[0] == 404
        # The room registry
        assert _call("POST", f"{base}/register_dp_rank", {"bootstrap_room": 12, "dp_rank": 1}) == (200, "OK")
        status, body = _call("POST", f"{base}/query_dp_ranks", {"bootstrap_rooms": [12, 13]})
        assert status == 200 and json.loads(body) == {"12": 1}
        assert _call("POST", f"{base}/register_dp_rank", {"bootstrap_room": "x"})[0] == 400
        registrar = RoomRegistrar(base, dp_rank=0)
        registrar.add(14)
        deadline = time.monotonic() + 10
        while "14" not in json.loads(_call("POST", f"{base}/query_dp_ranks", {"bootstrap_rooms": [14]})[1]):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        registrar.close()
    finally:
        server.close()


def test_auto_load_balance_method_follows_the_room_on_a_prefill_server():
    assert resolve_load_balance_method("auto", "prefill") == "follow_bootstrap_room"
    assert resolve_load_balance_method("auto", "decode") == "round_robin"
    assert resolve_load_balance_method("auto", "null") == "round_robin"
    assert resolve_load_balance_method("shortest_queue", "prefill") == "shortest_queue"
    ServerArgs(disaggregation_mode="prefill", dp_size=2).validate()  # dp > 1 on either side
    ServerArgs(disaggregation_mode="decode", dp_size=2, tp_size=2).validate()
    with pytest.raises(ValueError, match="--load-balance-method"):
        ServerArgs(load_balance_method="random").validate()


def test_request_field_disagg_prefill_dp_rank():
    items = GenerateReqInput(text="a", disagg_prefill_dp_rank=1, sampling_params={"n": 2}).expand()
    assert [i.routing.disagg_prefill_dp_rank for i in items] == [1, 1]
    with pytest.raises(ValueError, match="disagg_prefill_dp_rank must be >= 0"):
        GenerateReqInput(text="a", disagg_prefill_dp_rank=-1).expand()


def _req(
    room: int | None, routed: int | None = None, prefill_rank: int | None = None
) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        "r",
        "",
        [1, 2],
        SamplingParams(),
        routed_dp_rank=routed,
        routing=DisaggRouting(bootstrap_room=room, disagg_prefill_dp_rank=prefill_rank),
    )


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_controller_places_pd_requests(mode):
    ports = PortArgs.create().with_dp_controller()
    controller = DataParallelController(ServerArgs(dp_size=2, disaggregation_mode=mode), ports)
    try:
        if mode == "prefill":  # auto = follow_bootstrap_room: room % replicas
            assert [controller.target_of(_req(room)) for room in (7, 8, 9)] == [1, 0, 1]
            assert controller.target_of(_req(7, routed=0)) == 0  # routed_dp_rank wins
            assert controller.target_of(_req(8, prefill_rank=1)) == 1  # one body sent to both halves
        else:  # auto = round_robin; disagg_prefill_dp_rank names the prefill server's replica
            assert [controller.target_of(_req(7, prefill_rank=1)) for _ in range(4)] == [0, 1, 0, 1]
            assert controller.target_of(_req(7, routed=1)) == 1
        assert controller.target_of(_req(None)) in (0, 1)  # a probe without a room
    finally:
        controller.close()
        ports.cleanup()


def _layout() -> KVLayout:
    return KVLayout(
        page_size=1,
        kv_cache_dtype="float32",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        tp_size=1,
        tp_rank=0,
        heads=(0, HEADS),
    )


def _wait(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("method", "room", "pinned", "registered"),
    [
        ("follow_bootstrap_room", 7, None, False),  # 7 % 2 = 1: derived from the room
        ("follow_bootstrap_room", 8, 1, False),  # routed elsewhere: disagg_prefill_dp_rank says where
        ("round_robin", 8, None, True),  # the decode side asks the bootstrap server
    ],
)
def test_tcp_backend_takes_the_kv_from_the_replica_holding_the_room(method, room, pinned, registered):
    """Two prefill replicas (one rank each) behind one bootstrap server; replica 1 holds the room.
    The decode side connects to both, and takes the room's KV from replica 1 only."""
    server = BootstrapServer("127.0.0.1", 0)
    replicas = [PrefillTcpManager("127.0.0.1", _layout(), timeout_s=30) for _ in range(2)]
    decode = DecodeTcpManager(_layout(), timeout_s=30)
    try:
        for d, manager in enumerate(replicas):
            manager.register("127.0.0.1", server.port, ReplicaInfo(d, 2, method))
        if registered:
            server.table.register_room(room, 1)
        sender = replicas[1].create_sender(room)
        receiver = decode.create_receiver(room, "127.0.0.1", server.port, pinned)
        _wait(lambda: receiver.poll() == KVPoll.WaitingForInput)
        receiver.init(3)
        _wait(lambda: sender.poll() == KVPoll.WaitingForInput)
        pool = MHATokenToKVPool(16, 1, torch.float32, LAYERS, HEADS, HEAD_DIM, "cpu")
        pool.k_buffer[0][torch.arange(3)] = 1.5
        sender.send({"first_token": 4}, lambda heads: wire.gather_kv(pool, torch.arange(3), heads))
        _wait(lambda: receiver.poll() == KVPoll.Success and sender.poll() == KVPoll.Success)
        meta, pieces = receiver.result()
        assert meta["first_token"] == 4 and len(pieces) == 1
        assert room not in replicas[0].rooms  # replica 0 never heard of it
    finally:
        for manager in (*replicas, decode):
            manager.close()
        server.close()


def test_a_prefill_replica_that_does_not_exist_fails_both_halves():
    server = BootstrapServer("127.0.0.1", 0)
    replicas = [PrefillTcpManager("127.0.0.1", _layout(), timeout_s=30) for _ in range(2)]
    decode = DecodeTcpManager(_layout(), timeout_s=30)
    try:
        for d, manager in enumerate(replicas):
            manager.register("127.0.0.1", server.port, ReplicaInfo(d, 2))
        sender = replicas[0].create_sender(4)
        receiver = decode.create_receiver(4, "127.0.0.1", server.port, prefill_dp_rank=5)
        _wait(lambda: receiver.poll() == KVPoll.Failed)
        assert receiver.status.error_status_code == 400
        assert "disagg_prefill_dp_rank 5 is out of range" in receiver.status.error
        assert "2 data-parallel replica(s)" in receiver.status.error
        # The replica that got the prefill half hears of it at once (no 300 s wait).
        _wait(lambda: sender.poll() == KVPoll.Failed)
        assert "out of range" in sender.status.error
    finally:
        for manager in (*replicas, decode):
            manager.close()
        server.close()
