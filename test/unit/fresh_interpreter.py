"""Run a probe in a fresh interpreter: what a new process (a server's main process, a spawned
child) imports or decides, free of whatever this test process already imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def probe_json(code: str, *argv: str) -> Any:  # noqa: ANN401 - the probe's own JSON
    """Run `code` with `argv` in a new interpreter (this one's executable and environment); it
    must exit 0, and print its answer as JSON on its last line of stdout."""
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])
