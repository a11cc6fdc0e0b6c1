"""The scheduler subprocess: the model worker and the Scheduler behind ZMQ sockets.

Sockets (rank 0 only): requests arrive on a PULL socket (from the TokenizerManager);
BatchTokenIDOut goes to the detokenizer (with --detokenizer inline: to the TokenizerManager, which
decodes it itself); control replies
(flush, internal state) go straight back to the TokenizerManager.

With --tp-size / --pp-size above 1 there is one such process per rank (the same
`run_scheduler_process`; a single rank is a world of size 1). Rank 0 alone owns the sockets: what it receives it broadcasts to its TP peers over the CPU group, later
pipeline stages receive it from the previous stage, every rank runs the same scheduler, and only
rank 0 sends outputs (docs/architecture.md, "Ranks").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import zmq

from radixserve.managers.io_struct import (
    BatchTokenIDOut,
    GetInternalStateReqOutput,
    RpcReqOutput,
)
from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs, get_zmq_socket

if TYPE_CHECKING:
    from radixserve.distributed.layout import ParallelLayout
    from radixserve.distributed.rank_runtime import RankRuntime
    from radixserve.scheduler.loops import Loop

    # Imported at run time in build_scheduler, once the process set its threads (torch loads then).
    from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

# While idle, block this long for a request before running the idle self-check again.
IDLE_POLL_MS = 1000


class SchedulerIO:
    """Receives requests without blocking while there is work, and routes outputs by type.

    A data-parallel replica's rank 0 (port_args.dp_controller_ipc_name set) also stamps its
    dp_rank on what it sends and reports its load to the DataParallelController."""

    def __init__(
        self, port_args: PortArgs, load_watch_interval: float = 0.1, inline_detokenizer: bool = False
    ) -> None:
        self.context = zmq.Context(2)
        # --detokenizer inline: the step messages go to the tokenizer manager, which decodes them
        # itself (one process fewer woken per token); else to the detokenizer process.
        self.inline_detokenizer = inline_detokenizer
        self.recv = get_zmq_socket(self.context, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True)
        self.to_detokenizer = get_zmq_socket(
            self.context, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False
        )
        self.to_tokenizer = get_zmq_socket(self.context, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False)
        # The RPC channel (seed 002 §3.1): the Engine's calls that need a reply of their own.
        self.recv_from_rpc = (
            get_zmq_socket(self.context, zmq.DEALER, port_args.rpc_ipc_name, bind=True)
            if port_args.rpc_ipc_name
            else None
        )
        self.poller = zmq.Poller()
        for sock in (self.recv, self.recv_from_rpc):
            if sock is not None:
                self.poller.register(sock, zmq.POLLIN)
        self.dp_rank = port_args.dp_rank
        self.to_controller = (
            get_zmq_socket(self.context, zmq.PUSH, port_args.dp_controller_ipc_name, bind=False)
            if port_args.dp_controller_ipc_name
            else None
        )
        self.load_watch_interval = load_watch_interval
        self._last_report: tuple[int, int, int] | None = None
        self._last_report_time = float(
            "-inf"
        )  # time.monotonic() starts near 0 at boot: never throttle the first

    def recv_requests(self, block: bool) -> list[object]:
        msgs: list[object] = []
        if block and not self.poller.poll(IDLE_POLL_MS):
            return msgs
        for sock in (self.recv, self.recv_from_rpc):
            # ZMQ_EVENTS says whether a message waits without a failed receive: a zmq.Again raised
            # per socket per step is an exception built every step, in host work that runs with
            # cold caches (docs/cpu_backend.md, "Host work around a step").
            while sock is not None and sock.get(zmq.EVENTS) & zmq.POLLIN:
                try:
                    msgs.append(sock.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    break
        return msgs

    def has_input(self) -> bool:
        """Whether a message waits, without reading it (a zero-timeout poll)."""
        return bool(self.poller.poll(0))

    def send_output(self, msg: object) -> None:
        if isinstance(msg, RpcReqOutput) and self.recv_from_rpc is not None:
            self.recv_from_rpc.send_pyobj(msg)
            return
        if self.dp_rank:
            msg = _stamp_dp_rank(msg, self.dp_rank)
        to_detokenizer = isinstance(msg, BatchTokenIDOut) and not self.inline_detokenizer
        sock = self.to_detokenizer if to_detokenizer else self.to_tokenizer
        sock.send_pyobj(msg)

    def report_load(self, scheduler: Scheduler, force: bool = False) -> None:
        """Send this replica's load to the controller when it changed, at most every interval s, or
        now whatever the interval (`force`): before the loop blocks waiting for input, when no later
        step would send it, the controller must not keep dispatching on the load of a busy replica."""
        if self.to_controller is None:
            return
        now = time.monotonic()
        if not force and now - self._last_report_time < self.load_watch_interval:
            return
        load = scheduler.get_load()
        key = (load.num_reqs, load.num_waiting_reqs, load.num_tokens)
        if key == self._last_report:
            return
        self._last_report, self._last_report_time = key, now
        self.to_controller.send_pyobj(load)  # the scheduler names its replica (Scheduler.dp_rank)


def _start_watchdog(server_args: ServerArgs, scheduler: Scheduler) -> None:
    from radixserve.scheduler.watchdog import SchedulerWatchdog

    SchedulerWatchdog(
        server_args.watchdog_timeout, lambda: scheduler.num_steps, lambda: not scheduler.is_idle()
    ).start()


def _stamp_dp_rank(msg: object, dp_rank: int) -> object:
    """Name the replica in the outputs the scheduler does not stamp itself (its token batches and
    internal state; its load carries Scheduler.dp_rank already)."""
    if isinstance(msg, BatchTokenIDOut):
        return dataclasses.replace(msg, dp_rank=dp_rank)
    if isinstance(msg, GetInternalStateReqOutput):
        return GetInternalStateReqOutput(internal_state={**msg.internal_state, "dp_rank": dp_rank})
    return msg


def recv_and_report(io: SchedulerIO, scheduler: Scheduler) -> Callable[[], list[object]]:
    """The event loop's receive step: report the load (replicas only), then read the socket."""

    def recv() -> list[object]:
        block = scheduler.should_block_on_recv()
        io.report_load(scheduler, force=block)
        return io.recv_requests(block=block)

    return recv


def build_scheduler(
    server_args: ServerArgs,
    send_output: Callable[[object], None],
    rank: RankRuntime | None = None,
    dp_rank: int = 0,
    device: str | None = None,  # this rank's (place_rank); None: the resolved device
) -> tuple[Scheduler, dict[str, Any]]:
    """Load the model and build the Scheduler; returns it with the readiness report."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.managers.hf_tokenizer import load_tokenizer
    from radixserve.model_executor.worker_stack import build_model_worker
    from radixserve.scheduler.scheduler import Scheduler

    model_config = ModelConfig.from_path(
        server_args.model_path,
        server_args.context_length,
        server_args.dtype,
        server_args.device,
        is_embedding=server_args.is_embedding,
    )
    worker = build_model_worker(server_args, model_config, rank, device)
    tokenizer = load_tokenizer(server_args)
    scheduler = Scheduler(
        server_args, worker, tokenizer, model_config.eos_token_ids, send_output, sync=rank, dp_rank=dp_rank
    )
    max_req_len = min(model_config.context_len, worker.pools.max_total_num_tokens)
    info = {
        "status": "ready",
        "max_total_num_tokens": worker.pools.max_total_num_tokens,
        "max_req_input_len": max_req_len - 1,
        "context_len": model_config.context_len,
        "vocab_size": model_config.vocab_size,
        "hidden_size": model_config.hidden_size,
        "pid": os.getpid(),
        "is_generation": model_config.is_generation,
        "embedding": embedding_info(model_config),
    }
    return scheduler, info


def embedding_info(model_config: Any) -> dict[str, Any] | None:  # noqa: ANN401 - a ModelConfig
    """What the TokenizerManager needs to know about a model that does not generate."""
    cfg = model_config.embedding
    if cfg is None:
        return None
    return {
        "pooling": cfg.pooling.value,
        "normalize": cfg.normalize,
        "is_classifier": cfg.is_classifier,
        "is_causal": cfg.is_causal,
        "num_labels": cfg.num_labels,
        "id2label": dict(cfg.id2label),
        "matryoshka_dimensions": (
            list(cfg.matryoshka_dimensions) if cfg.matryoshka_dimensions is not None else None
        ),
        "hidden_size": model_config.hidden_size,
    }


def run_scheduler_process(
    server_args: ServerArgs,
    port_args: PortArgs | None,
    pipe: Connection,
    rank: int = 0,
    init_addr: str | None = None,
) -> None:
    """The one scheduler process entry: place this rank, join its world (a single rank is a world
    of size 1 and joins none), load its shard, report readiness over `pipe`, run the loop.
    `port_args` is None on nodes other than 0 (headless); only the world's entry rank has sockets."""
    from radixserve.scheduler.build import build_loop

    layout = server_args.layout()
    info = layout.rank_info(rank)
    dp_rank = port_args.dp_rank if port_args is not None else 0
    name = " ".join(["scheduler"] + [f"DP{dp_rank}"] * (server_args.dp_size > 1))
    name += "" if layout.is_single else f" TP{info.tp_rank} PP{info.pp_rank}"
    logging.basicConfig(
        level=server_args.log_level.upper(), format=f"[%(asctime)s {name}] %(levelname)s %(message)s"
    )
    try:
        device, threads, cores = place_rank(server_args, layout, info.local_rank, dp_rank)
        runtime, scheduler, io, ready = _build_rank(server_args, port_args, rank, init_addr, device)
        has_input = io.has_input if io is not None and runtime is None else None
        loop = build_loop(scheduler, has_input)  # before readiness: the PD side binds its ports here
        if runtime is not None:
            ready["rank_info"] = {
                **dataclasses.asdict(info),
                "pid": os.getpid(),
                "host": os.uname().nodename,
                "device": device,
                "threads": threads,
                "cores": cores,
            }
            ready["ranks"] = runtime.gather(ready["rank_info"])
    except Exception as exc:
        who = "scheduler" if layout.is_single else f"rank {rank}"
        logger.exception("The %s failed to start", who)
        pipe.send({"status": "error", "message": f"{who} failed to start: {exc!r}"})
        raise
    pipe.send(ready)
    logger.info(
        "Rank %d ready (%d threads on cores %s): max_total_num_tokens=%d, context_len=%d, overlap=%s",
        rank,
        threads,
        cores or "any",
        ready["max_total_num_tokens"],
        ready["context_len"],
        not server_args.disable_overlap_schedule,
    )
    try:
        _run_loop(server_args, runtime, scheduler, loop, io)
    except Exception as exc:  # a peer died, a collective timed out, or a bug: never hang
        logger.error(
            "Rank %d stops: %s: %s. A rank that stops ends the server (the others see its sockets "
            "close or their collectives time out).",
            rank,
            type(exc).__name__,
            exc,
            exc_info=not _is_peer_failure(exc),  # a bug gets its traceback; a lost peer one line
        )
        logging.shutdown()
        os._exit(1)  # skip the process-group teardown, which would wait on the dead peer


def _is_peer_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        what in text for what in ("closed by peer", "Connection reset", "exited while", "timed out")
    )


def place_rank(
    server_args: ServerArgs, layout: ParallelLayout, local_rank: int, dp_rank: int = 0
) -> tuple[str, int, list[int]]:
    """This rank's device (ServerArgs.rank_device) and its share of the node's cores (pinned, so
    ranks never contend); data-parallel replicas take consecutive blocks of cores. A single rank
    keeps the process's threads unless --cpu-threads or --dp-size say otherwise."""
    import torch

    device = server_args.rank_device(local_rank, dp_rank)
    if server_args.device == "cuda" or (
        layout.is_single and not (server_args.device == "cpu" and server_args.cpu_threads)
    ):
        return device, torch.get_num_threads(), []
    if layout.is_single and server_args.dp_size == 1:
        torch.set_num_threads(server_args.cpu_threads)
        return device, torch.get_num_threads(), []
    threads, cores = layout.cpu_cores(local_rank, server_args.cpu_threads, dp_rank)
    if cores:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    if layout.is_single:
        logger.info("Replica %d: %d threads on cores %s", dp_rank, threads, cores or "any")
    return device, threads, cores


def _build_rank(
    server_args: ServerArgs, port_args: PortArgs | None, rank: int, init_addr: str | None, device: str
) -> tuple[RankRuntime | None, Scheduler, SchedulerIO | None, dict[str, Any]]:
    from radixserve.distributed.rank_runtime import RankRuntime

    runtime = None
    if not server_args.layout().is_single:
        assert init_addr is not None, "a multi-rank world needs its rendezvous address"
        runtime = RankRuntime.for_server(server_args, rank, init_addr, device)
    is_entry = runtime is None or runtime.is_entry_rank
    io = (
        SchedulerIO(port_args, server_args.load_watch_interval, server_args.detokenizer == "inline")
        if is_entry and port_args is not None
        else None
    )
    send_output = io.send_output if io is not None else (lambda msg: None)
    dp_rank = port_args.dp_rank if port_args is not None else 0
    scheduler, ready = build_scheduler(server_args, send_output, runtime, dp_rank, device)
    return runtime, scheduler, io, ready


def _run_loop(
    server_args: ServerArgs,
    runtime: RankRuntime | None,
    scheduler: Scheduler,
    loop: Loop,
    io: SchedulerIO | None,
) -> None:
    _start_watchdog(server_args, scheduler)
    recv_io = recv_and_report(io, scheduler) if io is not None else (lambda: [])
    recv = recv_io
    if runtime is not None and runtime.layout.tp_size > 1:
        from radixserve.distributed.communication import broadcast_pyobj

        groups = runtime.groups
        tp_src = runtime.layout.rank_of(groups.pp_rank, 0)

        def recv() -> list[object]:
            """Rank 0 reads the socket; its TP peers get the same list over the CPU group."""
            msgs = recv_io() if io is not None else None
            return broadcast_pyobj(msgs, tp_src, groups.tp_cpu, is_src=groups.tp_rank == 0)

    loop.run_forever(recv)
