"""Runs a function on N spawned ranks joined by a gloo group on 127.0.0.1, each with a
ShmCommunicator, and collects what each rank returns: the harness of the shared-memory
communicator tests. Every rank process is killed and reaped when the run ends, however it ends."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import torch

from radixserve.testing.ranks import collect_from_ranks

# Slots of 4 KiB: 1024 fp32 per chunk, so modest sizes already cross several chunks.
SMALL_SLOT = 4096


def digest(t: torch.Tensor) -> str:
    """The bits of a tensor, to compare ranks' results without shipping them."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _with_comm(rank: int, world: int, fn: Callable[..., Any], comm_kwargs: dict | None, *args: Any) -> Any:  # noqa: ANN401
    import torch.distributed as dist

    from radixserve.distributed.shm_comm import ShmCommunicator

    group = dist.group.WORLD
    comm = None if comm_kwargs is None else ShmCommunicator.create(group, "test", **comm_kwargs)
    return fn(comm, group, rank, world, *args)


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
    return collect_from_ranks(
        _with_comm, world, (fn, comm_kwargs, *args), timeout_s=timeout_s, threads=threads, expect=expect
    )


def pid_region_names(pid: int) -> list[str]:
    """The /dev/shm names a creator with this pid left behind (none once every rank attached)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith("radixserve-shm-") and f"-{pid}-" in n]
