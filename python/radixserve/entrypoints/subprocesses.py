"""Start the server's child processes (schedulers, detokenizer) and wait until they are ready."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.managers.decode_tokenizer import DecodeSpec
from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs, get_free_port
from radixserve.utils.process import ChildProcesses

logger = logging.getLogger(__name__)

SchedulerEntry = Callable[..., None]  # run(server_args, port_args, pipe)
# Called once the schedulers are started: the detokenizer's decode-only tokenizer, from the HF
# tokenizer the caller loads meanwhile (None: the detokenizer loads the HF tokenizer itself).
DetokenizerSpec = Callable[[], DecodeSpec | None]
STARTUP_TIMEOUT_S = 600.0  # the first start converts the default model's weights


def default_scheduler_entry() -> SchedulerEntry:
    from radixserve.scheduler.scheduler_process import run_scheduler_process

    return run_scheduler_process


@dataclass(frozen=True)
class StartedChildren:
    """The children of node 0, all ready, and what their start reported and took."""

    children: ChildProcesses
    info: dict[str, Any]  # rank 0's readiness report (merged over data-parallel replicas)
    start_s: float  # seconds from the first spawn to the last readiness report


def start_children(
    server_args: ServerArgs,
    port_args: PortArgs,
    scheduler_entry: SchedulerEntry | None = None,
    detokenizer_spec: DetokenizerSpec | None = None,
) -> StartedChildren:
    """`launch_subprocesses`, timed."""
    started = time.monotonic()
    children, info = launch_subprocesses(server_args, port_args, scheduler_entry, None, detokenizer_spec)
    return StartedChildren(children, info, time.monotonic() - started)


def launch_subprocesses(
    server_args: ServerArgs,
    port_args: PortArgs,
    scheduler_entry: SchedulerEntry | None = None,
    children: ChildProcesses | None = None,
    detokenizer_spec: DetokenizerSpec | None = None,
) -> tuple[ChildProcesses, dict[str, Any]]:
    """Start every child of node 0 (into `children`, else a new set) and return them with rank
    0's readiness info.

    `scheduler_entry` replaces the real scheduler process (tests pass a fake one, single rank
    only); it is called as `entry(server_args, port_args, pipe)`. A restart passes the set it
    holds, so a shutdown meanwhile can stop children that are still starting. The detokenizer
    starts after the schedulers, once `detokenizer_spec()` returns (an error it raises stops the
    children and is raised here).
    """
    from radixserve.managers.detokenizer_manager import run_detokenizer_process

    children = children if children is not None else ChildProcesses()
    try:
        if server_args.dp_size > 1:
            start_dp_replicas(children, server_args, port_args, scheduler_entry)
        elif server_args.layout().is_single:
            entry = scheduler_entry or default_scheduler_entry()
            children.start("scheduler", entry, (server_args, port_args))
        else:
            start_rank_processes(children, server_args, port_args)
        spec = detokenizer_spec() if detokenizer_spec is not None else None
        children.start("detokenizer", run_detokenizer_process, (server_args, port_args, spec))
        infos = children.wait_ready(STARTUP_TIMEOUT_S)
    except BaseException:
        children.terminate()
        raise
    info = merge_replica_infos(infos, server_args) if server_args.dp_size > 1 else infos[0]
    for key in ("context_len", "max_total_num_tokens"):
        if key not in info:
            children.terminate()
            raise RuntimeError(f"scheduler readiness report lacks {key!r}: {info}")
    logger.info("Child processes ready: %s", {k: v for k, v in info.items() if k != "ranks"})
    return children, info


def start_rank_processes(
    children: ChildProcesses, server_args: ServerArgs, port_args: PortArgs | None
) -> None:
    """One scheduler process per rank of this node (`port_args` None: a headless node). A
    data-parallel replica (port_args.dp_rank) gets a torch.distributed world of its own.

    The model's layout is checked once the ranks are started, before anything waits on them: the
    check reads the model's config (torch and transformers' config stack, ~4.5 CPU s in a fresh
    server process), which the ranks' own start-up then overlaps. A layout it refuses raises here,
    and the caller terminates the ranks (each caller stops its children on any error)."""
    from radixserve.scheduler.scheduler_process import run_scheduler_process

    layout = server_args.layout()
    dp_rank = port_args.dp_rank if port_args is not None else 0
    if server_args.dist_init_addr and server_args.dp_size == 1:
        init_addr = server_args.dist_init_addr
    else:  # each replica's world meets on its own port
        init_addr = f"127.0.0.1:{get_free_port()}"
    dp = f"DP{dp_rank}-" if server_args.dp_size > 1 else ""
    logger.info(
        "Starting %sranks %s of %d (tp %d x pp %d over %d node(s)); rendezvous at %s",
        dp.replace("-", " "),
        list(layout.local_ranks()),
        layout.world_size,
        layout.tp_size,
        layout.pp_size,
        layout.nnodes,
        init_addr,
    )
    for rank in layout.local_ranks():
        info = layout.rank_info(rank)
        name = f"scheduler-{dp}TP{info.tp_rank}-PP{info.pp_rank}"
        entry = functools.partial(run_scheduler_process, rank=rank, init_addr=init_addr)
        children.start(name, entry, (server_args, port_args))
    check_model_layout(server_args)


def start_dp_replicas(
    children: ChildProcesses,
    server_args: ServerArgs,
    port_args: PortArgs,
    scheduler_entry: SchedulerEntry | None = None,
) -> None:
    """--dp-size replicas (each a full TP x PP group, or one scheduler) and their controller.

    Replicas start first, so the readiness reports come back replica by replica; each one's rank 0
    reads its own socket (`PortArgs.for_dp_rank`) and reports its load to the controller."""
    from radixserve.managers.data_parallel_controller import run_data_parallel_controller

    port_args = port_args.with_dp_controller()
    logger.info(
        "Starting %d data-parallel replicas (--load-balance-method %s)",
        server_args.dp_size,
        server_args.load_balance_method,
    )
    for dp_rank in range(server_args.dp_size):
        replica_ports = port_args.for_dp_rank(dp_rank)
        if server_args.layout().is_single:
            entry = scheduler_entry or default_scheduler_entry()
            children.start(f"scheduler-DP{dp_rank}", entry, (server_args, replica_ports))
        else:
            start_rank_processes(children, server_args, replica_ports)
    children.start("dp-controller", run_data_parallel_controller, (server_args, port_args))


def merge_replica_infos(infos: list[dict[str, Any]], server_args: ServerArgs) -> dict[str, Any]:
    """One readiness report for the TokenizerManager: the tightest limits of any replica, and
    every replica's ranks (with their dp_rank) in /get_server_info's `ranks`."""
    per_replica = server_args.layout().ranks_per_node
    replicas = [infos[d * per_replica] for d in range(server_args.dp_size)]
    merged = dict(replicas[0])
    for key in ("max_total_num_tokens", "max_req_input_len", "context_len"):
        merged[key] = min(int(r[key]) for r in replicas if key in r)
    ranks: list[dict[str, Any]] = []
    for dp_rank, info in enumerate(replicas):
        own = info.get("ranks") or [
            {"rank": 0, "tp_rank": 0, "pp_rank": 0, "node_rank": 0, "pid": info.get("pid")}
        ]
        ranks.extend({**r, "dp_rank": dp_rank} for r in own)
    merged["ranks"] = ranks
    return merged


def import_transformers_before_threads(server_args: ServerArgs) -> None:
    """Import transformers now, on the calling thread, when starting the children will read the
    model's config (check_model_layout: a layout of several ranks, or DP replicas) while the
    tokenizer loads on another thread. transformers' package import is not safe in two threads
    at once: its __init__ swaps its module for a lazy one at the end, and a thread that meets the
    half-made module fails with "cannot import name 'AutoConfig'". One rank needs nothing here."""
    if server_args.dp_size > 1 or not server_args.layout().is_single:
        import transformers  # noqa: F401


def check_model_layout(server_args: ServerArgs) -> None:
    """Refuse a layout the model cannot be split into (LayoutError, naming the flag to change)."""
    from radixserve.configs.model_config import ModelConfig

    mc = ModelConfig.from_path(server_args.model_path, server_args.context_length, server_args.dtype)
    intermediate = int(getattr(mc.hf_config, "intermediate_size", server_args.tp_size))
    server_args.layout().check_model(mc.num_layers, mc.num_heads, mc.num_kv_heads, intermediate)
