"""Units of prefill/decode disaggregation: the transfer status rules, the bootstrap server's
routes, the flags and the request fields."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from radixserve.disaggregation.bootstrap_server import BootstrapServer
from radixserve.disaggregation.utils import KVPoll, TransferStatus
from radixserve.managers.generate_request import GenerateReqInput
from radixserve.server_args import ServerArgs


def test_status_only_moves_forward_and_failed_wins():
    s = TransferStatus(timeout_s=300)
    assert s.poll() == KVPoll.Bootstrapping
    assert s.advance(KVPoll.Transferring)
    assert not s.advance(KVPoll.WaitingForInput)  # never backwards
    assert s.poll() == KVPoll.Transferring
    assert s.fail("peer gone")
    assert not s.advance(KVPoll.Success)  # a late success cannot revive a failed transfer
    assert s.poll() == KVPoll.Failed and s.error == "peer gone"
    done = TransferStatus(timeout_s=300)
    assert done.advance(KVPoll.Success)
    assert not done.fail("late failure")  # final states are final
    assert done.poll() == KVPoll.Success


def test_status_timeout_counts_per_phase():
    s = TransferStatus(timeout_s=5)
    assert not s.expired(s.phase_started + 4)
    assert s.expired(s.phase_started + 6)
    s.advance(KVPoll.WaitingForInput)
    assert not s.expired(s.phase_started + 4)
    s.advance(KVPoll.Success)
    assert not s.expired(s.phase_started + 600)


def _call(method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_bootstrap_server_routes():
    server = BootstrapServer("127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert _call("GET", f"{base}/health") == (200, "OK")
        assert _call("GET", f"{base}/route?engine_rank=-1&target_dp_group=-1")[0] == 503  # nobody yet
        assert _call("GET", f"{base}/route")[0] == 400
        assert _call("PUT", f"{base}/route", {"role": "Prefill"})[0] == 400
        reg = {
            "role": "Prefill",
            "rank_ip": "127.0.0.1",
            "rank_port": 4567,
            "engine_rank": 0,
            "tp_size": 1,
            "dp_size": 1,
            "page_size": 16,
            "kv_cache_dtype": "float32",
        }
        assert _call("PUT", f"{base}/route", reg) == (200, "OK")
        status, body = _call("GET", f"{base}/route?engine_rank=-1&target_dp_group=-1")
        assert status == 200 and json.loads(body) == {
            "tp_size": 1,
            "dp_size": 1,
            "page_size": 16,
            "kv_cache_dtype": "float32",
            "follow_bootstrap_room": True,  # no load_balance_method registered: SGLang's default
        }
        status, body = _call("GET", f"{base}/route?engine_rank=0&target_dp_group=0")
        assert status == 200 and json.loads(body) == {"rank_ip": "127.0.0.1", "rank_port": 4567}
        assert _call("GET", f"{base}/route?engine_rank=3&target_dp_group=0")[0] == 404
        assert _call("POST", f"{base}/route", {})[0] == 405
    finally:
        server.close()


def test_flags_defaults_and_validation():
    args = ServerArgs()
    assert (args.disaggregation_mode, args.disaggregation_bootstrap_port) == ("null", 8998)
    assert (args.disaggregation_transfer_backend, args.disaggregation_bootstrap_timeout) == ("tcp", 300.0)
    with pytest.raises(ValueError, match="--disaggregation-mode"):
        ServerArgs(disaggregation_mode="both").validate()
    with pytest.raises(ValueError, match="--disaggregation-transfer-backend"):
        ServerArgs(disaggregation_transfer_backend="rdma").validate()
    ServerArgs(disaggregation_mode="prefill", tp_size=2).validate()  # any TP size on either side
    with pytest.raises(ValueError, match="--pp-size 1"):
        ServerArgs(disaggregation_mode="decode", pp_size=2).validate()
    with pytest.raises(ValueError, match="timeout"):
        ServerArgs(disaggregation_bootstrap_timeout=0).validate()


def test_request_fields_single_batch_and_samples():
    single = GenerateReqInput(
        text="hi", bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=7, sampling_params={"n": 2}
    )
    items = single.expand()
    assert [
        (i.routing.bootstrap_host, i.routing.bootstrap_port, i.routing.bootstrap_room) for i in items
    ] == [
        ("10.0.0.1", 8998, 7),
        ("10.0.0.1", 8998, 8),  # each sample is its own transfer, numbered the same on both sides
    ]
    batch = GenerateReqInput(
        text=["a", "b"], bootstrap_host=["h1", "h2"], bootstrap_port=[1, None], bootstrap_room=[3, 2**63 - 1]
    )
    assert [
        (i.routing.bootstrap_host, i.routing.bootstrap_port, i.routing.bootstrap_room) for i in batch.expand()
    ] == [
        ("h1", 1, 3),
        ("h2", None, 2**63 - 1),
    ]
    with pytest.raises(ValueError, match="bootstrap_room"):
        GenerateReqInput(text=["a", "b"], bootstrap_room=[1]).expand()
    with pytest.raises(ValueError, match="bootstrap_room"):
        GenerateReqInput(text="a", bootstrap_room=-1).expand()
