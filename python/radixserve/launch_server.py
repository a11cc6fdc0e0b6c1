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
    """Start the children first: the scheduler loads the model while this process loads the
    tokenizer (which the detokenizer then starts from), then imports the HTTP server, on threads."""
    from radixserve.entrypoints.subprocesses import import_transformers_before_threads, start_children
    from radixserve.managers.decode_tokenizer import decode_spec
    from radixserve.managers.hf_tokenizer import load_tokenizer
    from radixserve.utils.background import BackgroundCall
    from radixserve.utils.network import PortArgs

    import_transformers_before_threads(server_args)
    tokenizer = BackgroundCall(load_tokenizer, server_args, name="load-tokenizer")
    runtime_cls = BackgroundCall(_import_server_runtime, tokenizer, name="import-server")
    port_args = PortArgs.create()
    started = start_children(server_args, port_args, scheduler_entry, lambda: decode_spec(tokenizer.result()))
    # An import error is raised here, as it was when nothing overlapped (a tokenizer error already
    # was, by start_children); the children are then stopped at exit (ChildProcesses' atexit hook).
    return runtime_cls.result()(server_args, port_args, started, tokenizer.result(), scheduler_entry).run()


def _import_server_runtime(after: Any) -> type:
    """After `after` (the tokenizer's load): one import at a time, the one awaited first first."""
    after.wait()
    from radixserve.entrypoints.server_runtime import ServerRuntime

    return ServerRuntime


if __name__ == "__main__":
    launch_server(prepare_server_args())
