"""The scheduler subprocess: the model worker and the Scheduler behind ZMQ sockets.

Sockets: requests arrive on a PULL socket (from the TokenizerManager and, for stop-string aborts,
the detokenizer); BatchTokenIDOut goes to the detokenizer; control replies (flush, internal state)
go straight back to the TokenizerManager.
"""

from __future__ import annotations

import logging
import os
from multiprocessing.connection import Connection
from typing import Any

import zmq

from radixserve.managers.io_struct import BatchTokenIDOut
from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs, get_zmq_socket

logger = logging.getLogger(__name__)

# While idle, block this long for a request before running the idle self-check again.
IDLE_POLL_MS = 1000


class SchedulerIO:
    """Receives requests without blocking while there is work, and routes outputs by type."""

    def __init__(self, port_args: PortArgs) -> None:
        self.context = zmq.Context(2)
        self.recv = get_zmq_socket(self.context, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True)
        self.to_detokenizer = get_zmq_socket(
            self.context, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False
        )
        self.to_tokenizer = get_zmq_socket(self.context, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False)

    def recv_requests(self, block: bool) -> list[object]:
        msgs: list[object] = []
        if block and not self.recv.poll(IDLE_POLL_MS):
            return msgs
        while True:
            try:
                msgs.append(self.recv.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return msgs

    def send_output(self, msg: object) -> None:
        sock = self.to_detokenizer if isinstance(msg, BatchTokenIDOut) else self.to_tokenizer
        sock.send_pyobj(msg)


def _configure_threads(server_args: ServerArgs) -> None:
    """The scheduler process does the math: it gets the cores (other processes get one thread)."""
    import torch

    if server_args.device == "cpu" and server_args.cpu_threads:
        torch.set_num_threads(server_args.cpu_threads)


def build_scheduler(server_args: ServerArgs, send_output: Any) -> tuple[Any, dict[str, Any]]:  # noqa: ANN401
    """Load the model and build the Scheduler; returns it with the readiness report."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.managers.tokenizer_manager import load_tokenizer
    from radixserve.model_executor.tp_worker import TpModelWorker
    from radixserve.scheduler.scheduler import Scheduler

    model_config = ModelConfig.from_path(
        server_args.model_path, server_args.context_length, server_args.dtype, server_args.device
    )
    worker = TpModelWorker(server_args, model_config)
    tokenizer = load_tokenizer(server_args)
    scheduler = Scheduler(server_args, worker, tokenizer, model_config.eos_token_ids, send_output)
    max_req_len = min(model_config.context_len, worker.max_total_num_tokens)
    info = {
        "status": "ready",
        "max_total_num_tokens": worker.max_total_num_tokens,
        "max_req_input_len": max_req_len - 1,
        "context_len": model_config.context_len,
        "vocab_size": model_config.vocab_size,
        "pid": os.getpid(),
    }
    return scheduler, info


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, pipe: Connection) -> None:
    """Process entry: build everything, report readiness over `pipe`, then run the event loop."""
    logging.basicConfig(
        level=server_args.log_level.upper(), format="[%(asctime)s scheduler] %(levelname)s %(message)s"
    )
    try:
        _configure_threads(server_args)
        io = SchedulerIO(port_args)
        scheduler, info = build_scheduler(server_args, io.send_output)
    except Exception as exc:
        logger.exception("Scheduler failed to start")
        pipe.send({"status": "error", "message": f"scheduler failed to start: {exc!r}"})
        raise
    pipe.send(info)
    logger.info(
        "Scheduler ready: max_total_num_tokens=%d, context_len=%d, overlap=%s",
        info["max_total_num_tokens"],
        info["context_len"],
        not server_args.disable_overlap_schedule,
    )
    scheduler.event_loop(lambda: io.recv_requests(block=scheduler.is_idle()))
