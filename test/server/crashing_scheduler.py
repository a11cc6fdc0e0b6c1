"""The real scheduler with a test-only fault: it exits at once, as a segfault would (os._exit,
no cleanup, no reply), when it receives a generation request whose prompt contains the marker in
$RADIXSERVE_TEST_CRASH_MARKER. The hook lives here, in test code only: the server cannot be made to
crash this way without this script.

Run as a script it launches the real server (launch_server) with this scheduler:
    RADIXSERVE_TEST_CRASH_MARKER=XYZZY python test/server/crashing_scheduler.py --model-path ...
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

from radixserve.managers.io_struct import BatchTokenizedGenerateReqInput, TokenizedGenerateReqInput
from radixserve.server_args import ServerArgs
from radixserve.utils.network import PortArgs

CRASH_MARKER_ENV = "RADIXSERVE_TEST_CRASH_MARKER"
CRASH_EXIT_CODE = 86


def _is_poison(msg: object, marker: str) -> bool:
    reqs = msg.reqs if isinstance(msg, BatchTokenizedGenerateReqInput) else [msg]
    return any(isinstance(r, TokenizedGenerateReqInput) and marker in r.input_text for r in reqs)


def run_crashing_scheduler(server_args: ServerArgs, port_args: PortArgs, pipe: Connection) -> None:
    """Scheduler process entry with the real signature: the real scheduler, its receive step
    wrapped by the fault."""
    from radixserve.scheduler import scheduler_process
    from radixserve.scheduler.scheduler_process import SchedulerIO

    marker = os.environ[CRASH_MARKER_ENV]
    receive = SchedulerIO.recv_requests

    def recv_or_crash(self: SchedulerIO, block: bool) -> list[object]:
        msgs = receive(self, block)
        if any(_is_poison(msg, marker) for msg in msgs):
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
