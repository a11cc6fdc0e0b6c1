"""Run a function on N local ranks joined in a gloo world (tests of the distributed pieces).

    results = run_on_ranks(check_something, world_size=2, args=(seed,))   # one result per rank

`fn(rank, world_size, *args)` runs in a spawned process after torch.distributed is initialized on
127.0.0.1; it must be a module-level function (it is pickled by reference). A rank that raises, or
a world that does not finish within `timeout_s`, fails the call with the rank's traceback; every
process is gone when the call returns.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from radixserve.utils.network import get_free_port


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    threads: int,
    out: Any,  # noqa: ANN401
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        # Pickled here, by value: a tensor put on the queue as-is would be shared through a file
        # descriptor that dies with this process before the parent reads it.
        out.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def collect_from_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    timeout_s: float = 120.0,
    threads: int = 1,
    expect: set[int] | None = None,
) -> dict[int, Any]:
    """{rank: fn's return value} for the ranks in `expect` (default: all). A rank outside `expect`
    may die without answering (a test of a dead peer). Raises RuntimeError with the tracebacks if
    any rank raised, TimeoutError if an expected rank did not answer within `timeout_s`."""
    expect = set(range(world_size)) if expect is None else expect
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = get_free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, threads, out), daemon=True)
        for r in range(world_size)
    ]
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while not expect <= results.keys() and not errors and time.monotonic() < deadline:
            try:
                rank, ok, value = out.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        out.close()
    if errors:
        raise RuntimeError("\n".join(errors))
    missing = expect - results.keys()
    if missing:
        raise TimeoutError(f"ranks {sorted(missing)} did not answer within {timeout_s} s")
    return results


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), timeout_s: float = 120.0
) -> list[Any]:
    """fn's return value on every rank, in rank order (see collect_from_ranks)."""
    results = collect_from_ranks(fn, world_size, args, timeout_s)
    return [results[r] for r in range(world_size)]
