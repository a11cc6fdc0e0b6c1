"""Start the server's child processes (schedulers, detokenizer) and wait until they are ready."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs, get_free_port
from radixserve.utils.process import ChildProcesses

logger = logging.getLogger(__name__)

SchedulerEntry = Callable[..., None]  # run(server_args, port_args, pipe)
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
    """Start every child of node 0 and return them with rank 0's readiness info.

    `scheduler_entry` replaces the real scheduler process (tests pass a fake one, single rank
    only); it is called as `entry(server_args, port_args, pipe)`.
    """
    from radixserve.managers.detokenizer_manager import run_detokenizer_process

    children = ChildProcesses()
    try:
        if server_args.layout().is_single:
            entry = scheduler_entry or default_scheduler_entry()
            children.start("scheduler", entry, (server_args, port_args))
        else:
            start_rank_processes(children, server_args, port_args)
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
    logger.info("Child processes ready: %s", {k: v for k, v in info.items() if k != "ranks"})
    return children, info


def start_rank_processes(
    children: ChildProcesses, server_args: ServerArgs, port_args: PortArgs | None
) -> None:
    """One scheduler process per rank of this node (`port_args` None: a headless node)."""
    from radixserve.scheduler.scheduler_process import run_rank_process

    layout = server_args.layout()
    check_model_layout(server_args)
    init_addr = server_args.dist_init_addr or f"127.0.0.1:{get_free_port()}"
    logger.info(
        "Starting ranks %s of %d (tp %d x pp %d over %d node(s)); rendezvous at %s",
        list(layout.local_ranks()),
        layout.world_size,
        layout.tp_size,
        layout.pp_size,
        layout.nnodes,
        init_addr,
    )
    for rank in layout.local_ranks():
        info = layout.rank_info(rank)
        name = f"scheduler-TP{info.tp_rank}-PP{info.pp_rank}"
        children.start(name, run_rank_process, (server_args, port_args, rank, init_addr))


def check_model_layout(server_args: ServerArgs) -> None:
    """Refuse, before any rank starts, a layout the model cannot be split into."""
    from radixserve.configs.model_config import ModelConfig

    mc = ModelConfig.from_path(server_args.model_path, server_args.context_length, server_args.dtype)
    intermediate = int(getattr(mc.hf_config, "intermediate_size", server_args.tp_size))
    server_args.layout().check_model(mc.num_layers, mc.num_heads, mc.num_kv_heads, intermediate)
