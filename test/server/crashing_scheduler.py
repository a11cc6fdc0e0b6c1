"""The real scheduler with a test-only fault: it exits at once, as a segfault would (os._exit,
no cleanup, no reply), when it receives a generation request whose prompt contains the marker in
$RADIXSERVE_TEST_CRASH_MARKER; with RADIXSERVE_TEST_CRASH_HOW=raise it raises instead, as a bug in
the scheduler would (the scheduler process logs the traceback and exits 1). The prompt is the
request's text, or its token ids decoded when it came as ids (a crash dump replays ids). The hook
lives here, in test code only: the server cannot be made to crash this way without this script.

Run as a script it launches the real server (launch_server) with this scheduler:
    RADIXSERVE_TEST_CRASH_MARKER=XYZZY python test/server/crashing_scheduler.py --model-path ...
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from radixserve.managers.io_struct import BatchTokenizedGenerateReqInput, TokenizedGenerateReqInput
from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs

CRASH_MARKER_ENV = "RADIXSERVE_TEST_CRASH_MARKER"
CRASH_HOW_ENV = "RADIXSERVE_TEST_CRASH_HOW"  # "exit" (the default) or "raise"
CRASH_EXIT_CODE = 86


class PoisonedRequestError(RuntimeError):
    """What the scheduler raises on the marked request (RADIXSERVE_TEST_CRASH_HOW=raise)."""


def _is_poison(msg: object, marker: str, decode: Callable[[list[int]], str]) -> bool:
    reqs = msg.reqs if isinstance(msg, BatchTokenizedGenerateReqInput) else [msg]
    return any(
        isinstance(r, TokenizedGenerateReqInput) and marker in (r.input_text or decode(r.input_ids))
        for r in reqs
    )


def _decoder(server_args: ServerArgs) -> Callable[[list[int]], str]:
    """The model's tokenizer's decode, loaded on first use (only a request sent as ids needs it)."""
    loaded: list[Any] = []

    def decode(ids: list[int]) -> str:
        if not loaded:
            from transformers import AutoTokenizer

            loaded.append(AutoTokenizer.from_pretrained(server_args.tokenizer_path or server_args.model_path))
        return loaded[0].decode(ids)

    return decode


def run_crashing_scheduler(server_args: ServerArgs, port_args: PortArgs, pipe: Connection) -> None:
    """Scheduler process entry with the real signature: the real scheduler, its receive step
    wrapped by the fault."""
    from radixserve.scheduler import scheduler_process
    from radixserve.scheduler.scheduler_process import SchedulerIO

    marker = os.environ[CRASH_MARKER_ENV]
    raises = os.environ.get(CRASH_HOW_ENV, "exit") == "raise"
    decode = _decoder(server_args)
    receive = SchedulerIO.recv_requests

    def recv_or_crash(self: SchedulerIO, block: bool) -> list[object]:
        msgs = receive(self, block)
        if any(_is_poison(msg, marker, decode) for msg in msgs):
            if raises:
                raise PoisonedRequestError(f"test fault: a request's prompt contains {marker!r}")
            os._exit(CRASH_EXIT_CODE)
        return msgs

    SchedulerIO.recv_requests = recv_or_crash  # type: ignore[method-assign] - this child only
    scheduler_process.run_scheduler_process(server_args, port_args, pipe)


if __name__ == "__main__":
    # Import through the module name so spawned children can unpickle the entry point.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from crashing_scheduler import run_crashing_scheduler as entry

    from radixserve.launch_server import launch_server
    from radixserve.server_args import prepare_server_args

    launch_server(prepare_server_args(sys.argv[1:]), scheduler_entry=entry)
