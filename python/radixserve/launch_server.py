"""`python -m radixserve.launch_server --model-path ... --port 30000`

Resolves the arguments and runs the server (entrypoints/server_runtime.py) until SIGTERM/SIGINT;
a node other than node 0 of a multi-node layout runs its ranks headless (entrypoints/headless_node.py).

This module stays light on purpose: multiprocessing's spawn re-imports the parent's __main__
module in every child before the child's target runs, so under `python -m radixserve.launch_server`
the scheduler and detokenizer processes import this file too. The HTTP stack (fastapi, uvicorn,
the protocol models) is imported inside `launch_server`, only in the process that serves, and
while the children start rather than before.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from radixserve.server_args import ServerArgs, prepare_server_args

if TYPE_CHECKING:
    from radixserve.entrypoints.subprocesses import SchedulerEntry


def launch_server(server_args: ServerArgs, scheduler_entry: SchedulerEntry | None = None) -> None:
    """Run a server until SIGTERM/SIGINT; `scheduler_entry` replaces the scheduler (tests)."""
    logging.basicConfig(
        level=server_args.log_level.upper(), format="[%(asctime)s %(processName)s] %(levelname)s %(message)s"
    )
    server_args = server_args.resolve()
    if server_args.node_rank > 0:
        # Not node 0: this node's ranks and a health endpoint; node 0 serves the API.
        from radixserve.entrypoints.headless_node import HeadlessNode

        sys.exit(HeadlessNode(server_args).run())
    sys.exit(_serve(server_args, scheduler_entry))


def _serve(server_args: ServerArgs, scheduler_entry: SchedulerEntry | None) -> int:
    """Start the children first: the scheduler loads the model while this process imports the
    HTTP server and loads the tokenizer (seconds of imports) on a thread."""
    from radixserve.entrypoints.subprocesses import start_children
    from radixserve.utils.background import BackgroundCall
    from radixserve.utils.network import PortArgs

    server_side = BackgroundCall(_import_server_and_load_tokenizer, server_args, name="server-imports")
    port_args = PortArgs.create()
    started = start_children(server_args, port_args, scheduler_entry)
    # An import or tokenizer error is raised here, as it was when nothing overlapped; the
    # children are then stopped at exit (ChildProcesses' atexit hook).
    runtime_cls, tokenizer = server_side.result()
    return runtime_cls(server_args, port_args, started, tokenizer, scheduler_entry).run()


def _import_server_and_load_tokenizer(server_args: ServerArgs) -> tuple[type, Any]:
    from radixserve.entrypoints.server_runtime import ServerRuntime
    from radixserve.managers.hf_tokenizer import load_tokenizer

    return ServerRuntime, load_tokenizer(server_args)


if __name__ == "__main__":
    launch_server(prepare_server_args())
