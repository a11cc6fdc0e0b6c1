"""Child-process entry points for test_restart_on_failure.py, in a module of their own that
imports nothing heavy: a spawned child imports the module of its target, and the test module's
imports (torch among them) would cost every child seconds."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection


def ready_then_sleep(pipe: Connection) -> None:
    pipe.send({"status": "ready", "pid": os.getpid()})
    time.sleep(600)
