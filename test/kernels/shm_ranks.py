"""Runs a function on N spawned ranks joined by a gloo group on 127.0.0.1, each with a
ShmCommunicator, and collects what each rank returns: the harness of the shared-memory
communicator tests. Every rank process is killed and reaped when the run ends, however it ends."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

# Slots of 4 KiB: 1024 fp32 per chunk, so modest sizes already cross several chunks.
SMALL_SLOT = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest(t: torch.Tensor) -> str:
    """The bits of a tensor, to compare ranks' results without shipping them."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _rank_main(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    comm_kwargs: dict | None,
    threads: int,
    results: mp.Queue,
) -> None:
    import torch.distributed as dist

    from radixserve.distributed.shm_comm import ShmCommunicator

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        group = dist.group.WORLD
        comm = None if comm_kwargs is None else ShmCommunicator.create(group, "test", **comm_kwargs)
        results.put((rank, "ok", fn(comm, group, rank, world, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    comm_kwargs: dict | None = None,
    with_comm: bool = True,
    threads: int = 1,
    expect: set[int] | None = None,
    timeout_s: float = 90.0,
) -> dict[int, Any]:
    """fn(comm, group, rank, world, *args) on each rank; {rank: its return value}. Raises if a rank
    raised. `expect`: the ranks that must answer (default all; a rank that kills itself answers
    nothing). comm_kwargs: ShmCommunicator.create's (default: SMALL_SLOT slots); with_comm=False:
    fn gets comm=None and makes its own."""
    if not with_comm:
        comm_kwargs = None
    elif comm_kwargs is None:
        comm_kwargs = {"slot_bytes": SMALL_SLOT, "timeout_s": 30.0}
    expect = set(range(world)) if expect is None else expect
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, world, port, fn, args, comm_kwargs, threads, results), daemon=True
        )
        for r in range(world)
    ]
    got: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while not expect <= got.keys() and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            if status == "ok":
                got[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                got[rank] = None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    assert not errors, "\n".join(errors)
    missing = expect - got.keys()
    assert not missing, f"ranks {sorted(missing)} did not answer within {timeout_s} s"
    return got


def pid_region_names(pid: int) -> list[str]:
    """The /dev/shm names a creator with this pid left behind (none once every rank attached)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith("radixserve-shm-") and f"-{pid}-" in n]
