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
    out: Any,  # noqa: ANN401
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
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


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), timeout_s: float = 120.0
) -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = get_free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, out)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = out.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(results))} did not finish"
                ) from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(1)
    return [results[r] for r in range(world_size)]
