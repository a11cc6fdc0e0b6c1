"""ControlClient's plumbing without sockets: a request awaits one reply of its declared type per
replica, replies go to waiters in order, other messages pass through, a missing reply times out;
every control request declares its ordering and reply type."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from radixserve.managers import io_struct as io
from radixserve.managers.control_client import ControlClient
from radixserve.managers.errors import RequestAbortedError


def _all_control_requests() -> list[type]:
    found, todo = [], [io.ControlReq]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def test_every_control_request_declares_its_ordering_and_reply() -> None:
    requests = _all_control_requests()
    assert io.UpdateWeightFromDiskReqInput in requests and io.AbortReq in requests
    for cls in requests:
        assert isinstance(cls.ordering, io.Ordering), cls
        assert cls.reply_type is None or dataclasses.is_dataclass(cls.reply_type), cls
    # The operations that change what a forward reads wait for the in-flight requests.
    barriers = {c for c in requests if c.ordering is io.Ordering.BARRIER}
    assert io.ReleaseMemoryOccupationReqInput in barriers and io.PauseGenerationReqInput not in barriers


def _client(dp_size: int, sent: list[object], versions: list | None = None) -> ControlClient:
    noted = versions if versions is not None else []
    return ControlClient(sent.append, dp_size, lambda: None, lambda v, p: noted.append((v, p)))


def test_ask_all_gathers_one_reply_per_replica_and_passes_other_messages() -> None:
    async def run() -> None:
        sent: list[object] = []
        client = _client(2, sent)
        task = asyncio.ensure_future(client.ask_all(io.FlushCacheReqInput()))
        await asyncio.sleep(0)
        assert sent == [io.FlushCacheReqInput()]
        assert not client.deliver(io.AbortReq("x"))  # not a reply: the TokenizerManager handles it
        assert client.deliver(io.ControlOutcome(True, "", answers="FlushCacheReqInput"))
        assert client.deliver(io.ControlOutcome(False, "busy", answers="FlushCacheReqInput"))
        assert await task == [
            io.ControlOutcome(True, "", answers="FlushCacheReqInput"),
            io.ControlOutcome(False, "busy", answers="FlushCacheReqInput"),
        ]
        assert client.deliver(
            io.ControlOutcome(True, "", answers="FlushCacheReqInput")
        )  # late: dropped, still a reply

    asyncio.run(run())


def test_a_refusing_replica_speaks_for_all_and_new_weights_are_reported() -> None:
    async def run() -> None:
        versions: list[tuple[str | None, str | None]] = []
        client = _client(2, [], versions)
        update = io.UpdateWeightFromDiskReqInput("/ckpt")
        task = asyncio.ensure_future(client.ask(update))
        await asyncio.sleep(0)
        client.deliver(io.UpdateWeightFromDiskReqOutput(True, "ok", 0, "v2"))
        client.deliver(io.UpdateWeightFromDiskReqOutput(False, "no such file"))
        assert (await task).message == "no such file" and versions == []
        task = asyncio.ensure_future(client.ask(update))
        await asyncio.sleep(0)
        for _ in range(2):
            client.deliver(io.UpdateWeightFromDiskReqOutput(True, "ok", 0, "v2"))
        assert (await task).success and versions == [("v2", "/ckpt")]

    asyncio.run(run())


def test_a_missing_reply_times_out_as_503() -> None:
    async def run() -> None:
        client = _client(1, [])
        with pytest.raises(RequestAbortedError) as err:
            await client.ask_all(io.GetLoadReqInput(), timeout=0.01)
        assert err.value.status_code == 503
        # The timed-out call left no waiter behind: the next call gets the next reply.
        task = asyncio.ensure_future(client.ask_all(io.GetLoadReqInput(), timeout=5))
        await asyncio.sleep(0)
        client.deliver(io.GetLoadReqOutput(0, 1, 0, 5))
        assert (await task)[0].num_reqs == 1

    asyncio.run(run())


def test_shared_outcome_replies_reach_the_request_they_answer() -> None:
    async def run() -> None:
        client = _client(1, [])
        pause = asyncio.ensure_future(client.ask_all(io.PauseGenerationReqInput()))
        freeze = asyncio.ensure_future(client.ask_all(io.FreezeGCReq()))
        await asyncio.sleep(0)
        # Both requests answer with ControlOutcome: each reply names the request it answers.
        assert client.deliver(io.ControlOutcome(True, "frozen", answers="FreezeGCReq"))
        assert client.deliver(io.ControlOutcome(True, "paused", answers="PauseGenerationReqInput"))
        assert (await pause)[0].message == "paused" and (await freeze)[0].message == "frozen"

    asyncio.run(run())
