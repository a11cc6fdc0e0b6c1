"""Start the server's child processes (schedulers, detokenizer) and wait until they are ready."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs
from radixserve.utils.process import ChildProcesses

logger = logging.getLogger(__name__)

SchedulerEntry = Callable[..., None]  # run(server_args, port_args, pipe) / (..., tp_rank, pipe)
STARTUP_TIMEOUT_S = 600.0  # the first start converts the default model's weights


def resolve_model_path(server_args: ServerArgs) -> ServerArgs:
    """Replace an empty / "default" --model-path by the converted default model's folder."""
    from radixserve.model_loader.default_model import resolve_model_path as resolve_path

    resolved = resolve_path(server_args.model_path)
    if resolved == server_args.model_path:
        return server_args
    return dataclasses.replace(server_args, model_path=resolved)


def default_scheduler_entry() -> SchedulerEntry:
    from radixserve.scheduler.scheduler_process import run_scheduler_process

    return run_scheduler_process


def launch_subprocesses(
    server_args: ServerArgs, port_args: PortArgs, scheduler_entry: SchedulerEntry | None = None
) -> tuple[ChildProcesses, dict[str, Any]]:
    """Start every child and return them with rank 0's readiness info.

    `scheduler_entry` replaces the real scheduler process (tests pass a fake one); it is called
    as `entry(server_args, port_args, pipe)`, with `tp_rank` before `pipe` when tp_size > 1.
    """
    from radixserve.managers.detokenizer_manager import run_detokenizer_process

    entry = scheduler_entry or default_scheduler_entry()
    children = ChildProcesses()
    try:
        for rank in range(server_args.tp_size):
            args = (server_args, port_args) if server_args.tp_size == 1 else (server_args, port_args, rank)
            children.start(f"scheduler-{rank}", entry, args)
        children.start("detokenizer", run_detokenizer_process, (server_args, port_args))
        infos = children.wait_ready(STARTUP_TIMEOUT_S)
    except BaseException:
        children.terminate()
        raise
    info = infos[0]
    for key in ("context_len", "max_total_num_tokens"):
        if key not in info:
            children.terminate()
            raise RuntimeError(f"scheduler readiness report lacks {key!r}: {info}")
    logger.info("Child processes ready: %s", info)
    return children, info
