"""The DataParallelController process (seed 001 §10): one front for --dp-size replicas.

    TokenizerManager ──ZMQ──► DataParallelController ──ZMQ──► replica d's rank 0 (d = 0..D-1)
        ▲                          ▲ GetLoadReqOutput (each replica, when its load changes)
        └── BatchStrOut ◄── Detokenizer ◄── BatchTokenIDOut (every replica, stamped with its dp_rank)

It binds the socket the TokenizerManager (and the detokenizer's stop-string aborts) send to, so
neither knows how many replicas there are. A generation request goes to one replica: the one it
names (`routed_dp_rank`; on a prefill server also `disagg_prefill_dp_rank`), or the one the
--load-balance-method picks (managers/dp_policy.py; follow_bootstrap_room: bootstrap_room modulo
the replicas, the prefill server's default).
Everything else fans out to every replica: aborts (a replica ignores rids it does not hold),
abort_all, flush_cache, internal state and load queries, BLOCK/UNBLOCK, and the control plane's
requests (weights, memory, pause, profiling, sessions: every replica applies them). Replicas answer
control requests straight to the TokenizerManager, which waits for one answer per replica. A
request continuing a session goes to the replica its session id hashes to (every replica opened
the session; only that one holds its turns and their KV).

The replicas are the server's children, not the controller's (a daemonic process cannot have
children), so the server's watchdog sees any of them die.
"""

from __future__ import annotations

import logging
import zlib
from collections import defaultdict
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import zmq

from radixserve.managers.dp_policy import CacheAwareConfig, Dispatcher
from radixserve.managers.io_struct import (
    BatchTokenizedGenerateReqInput,
    FlushCacheReqInput,
    GetLoadReqOutput,
    TokenizedGenerateReqInput,
    TypeBasedDispatcher,
)
from radixserve.server_args import ServerArgs, resolve_load_balance_method
from radixserve.utils.network import PortArgs, get_zmq_socket
from radixserve.utils.process import limit_threads

logger = logging.getLogger(__name__)


def make_dispatcher(server_args: ServerArgs) -> Dispatcher:
    config = CacheAwareConfig(
        cache_threshold=server_args.dp_cache_threshold,
        balance_abs_threshold=server_args.dp_balance_abs_threshold,
        balance_rel_threshold=server_args.dp_balance_rel_threshold,
    )
    method = resolve_load_balance_method(server_args.load_balance_method, server_args.disaggregation_mode)
    return Dispatcher(method, server_args.dp_size, config)


class DataParallelController:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs) -> None:
        assert port_args.dp_controller_ipc_name is not None, "PortArgs.with_dp_controller() was not applied"
        self.dp_size = server_args.dp_size
        self.dispatcher = make_dispatcher(server_args)
        self.is_prefill = server_args.disaggregation_mode == "prefill"
        self.context = zmq.Context(1)
        self.recv_from_tokenizer = get_zmq_socket(
            self.context, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True
        )
        self.recv_load = get_zmq_socket(self.context, zmq.PULL, port_args.dp_controller_ipc_name, bind=True)
        self.workers = [
            get_zmq_socket(self.context, zmq.PUSH, port_args.replica_input(d), bind=False)
            for d in range(self.dp_size)
        ]
        self.handle = TypeBasedDispatcher(
            [
                (TokenizedGenerateReqInput, self.dispatch),
                (BatchTokenizedGenerateReqInput, self.dispatch_batch),
                (FlushCacheReqInput, self.flush_cache),
                # Everything else fans out: aborts, state and load queries, BLOCK/UNBLOCK and the
                # control plane's requests (control_messages.py).
                (object, self.broadcast),
            ]
        )
        self.num_dispatched = [0] * self.dp_size
        self.poller = zmq.Poller()
        self.poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        self.poller.register(self.recv_load, zmq.POLLIN)

    # ------------------------------------------------------------------ dispatching
    def target_of(self, req: TokenizedGenerateReqInput) -> int:
        session = req.session_params.id if req.session_params is not None else None
        if session is not None and req.routed_dp_rank is None:
            target = zlib.crc32(session.encode()) % self.dp_size
            self.dispatcher.routed(target, req.input_ids)
        elif req.routed_dp_rank is not None:
            # The TokenizerManager refused ranks out of range (400); this is the last line.
            target = req.routed_dp_rank % self.dp_size
            self.dispatcher.routed(target, req.input_ids)
        elif self.is_prefill and req.routing.disagg_prefill_dp_rank is not None:
            # A PD load balancer that sends one body to both halves names the prefill replica once.
            target = req.routing.disagg_prefill_dp_rank % self.dp_size
            self.dispatcher.routed(target, req.input_ids)
        elif self.dispatcher.method == "follow_bootstrap_room" and req.routing.bootstrap_room is not None:
            # SGLang's follow_bootstrap_room: the decode side derives the replica the same way.
            target = req.routing.bootstrap_room % self.dp_size
            self.dispatcher.routed(target, req.input_ids)
        else:
            target = self.dispatcher.select(req.input_ids)
        self.num_dispatched[target] += 1
        return target

    def dispatch(self, req: TokenizedGenerateReqInput) -> None:
        self.workers[self.target_of(req)].send_pyobj(req)

    def dispatch_batch(self, batch: BatchTokenizedGenerateReqInput) -> None:
        """Each request of a batch (or each sample of n > 1) is placed on its own."""
        groups: dict[int, list[TokenizedGenerateReqInput]] = defaultdict(list)
        for req in batch.reqs:
            groups[self.target_of(req)].append(req)
        for target, reqs in groups.items():
            msg = reqs[0] if len(reqs) == 1 else BatchTokenizedGenerateReqInput(reqs=reqs)
            self.workers[target].send_pyobj(msg)

    def broadcast(self, msg: object) -> None:
        for sock in self.workers:
            sock.send_pyobj(msg)

    def flush_cache(self, msg: FlushCacheReqInput) -> None:
        self.dispatcher.on_flush()
        self.broadcast(msg)

    def on_load(self, load: GetLoadReqOutput) -> None:
        self.dispatcher.on_load(load.dp_rank, load.num_reqs, load.num_tokens)

    # ------------------------------------------------------------------ loop
    def poll_once(self, timeout_ms: int = 1000) -> None:
        ready = dict(self.poller.poll(timeout_ms))
        if self.recv_load in ready:
            _drain(self.recv_load, self.on_load)
        if self.recv_from_tokenizer in ready:
            # Loads first: a burst of requests is placed with the freshest reports.
            _drain(self.recv_load, self.on_load)
            _drain(self.recv_from_tokenizer, self.handle)

    def close(self) -> None:
        for sock in (self.recv_from_tokenizer, self.recv_load, *self.workers):
            sock.close(linger=0)
        self.context.term()

    def run_forever(self) -> None:
        while True:
            self.poll_once()


def _drain(sock: zmq.Socket, handle: Callable[[Any], object]) -> None:
    while True:
        try:
            msg = sock.recv_pyobj(zmq.NOBLOCK)
        except zmq.Again:
            return
        handle(msg)


def run_data_parallel_controller(server_args: ServerArgs, port_args: PortArgs, pipe: Connection) -> None:
    """Process entry: bind the sockets, report ready, dispatch forever."""
    limit_threads()
    logging.basicConfig(
        level=server_args.log_level.upper(), format="[%(asctime)s dp-controller] %(levelname)s %(message)s"
    )
    try:
        controller = DataParallelController(server_args, port_args)
    except Exception as exc:
        logger.exception("DataParallelController failed to start")
        pipe.send({"status": "error", "message": f"dp controller failed to start: {exc!r}"})
        raise
    pipe.send({"status": "ready", "role": "dp_controller"})
    logger.info(
        "DataParallelController ready: %d replicas, --load-balance-method %s",
        server_args.dp_size,
        server_args.load_balance_method,
    )
    controller.run_forever()
