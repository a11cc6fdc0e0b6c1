"""--crash-dump-folder: the last requests the schedulers received, written when a child dies.

The TokenizerManager records every generation request it sends (`record`) into a ring bounded in
requests and in bytes; when a scheduler or the detokenizer dies, the server (server_runtime.py,
healing.py, the Engine) writes the ring with the server args to one JSON file (`write`) and logs
its path. It lives in the HTTP process, so a scheduler killed outright (SIGKILL, a segfault, the
OOM killer) leaves a dump as surely as one that raised. scripts/replay_crash_dump.py sends the
requests again, in order and with their timing, to reproduce the crash (docs/observability.md).

The file is JSON, never pickle: a dump may travel in a bug report and must be safe to open.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.server_args import ServerArgs

if TYPE_CHECKING:
    from radixserve.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

DUMP_FORMAT = "radixserve-crash-dump"
DUMP_VERSION = 1
MAX_DUMP_REQUESTS = 256
MAX_DUMP_BYTES = 16 * 1024 * 1024  # the ring's estimate of its JSON size
MAX_TEXT_CHARS = 65536  # a longer prompt keeps its ids (what the scheduler ran) and a cut text


def request_record(req: TokenizedGenerateReqInput) -> dict[str, Any]:
    """What replays a request: its ids and sampling params as the scheduler got them."""
    return {
        "rid": req.rid,
        "received_time": req.received_time,
        "input_text": req.input_text[:MAX_TEXT_CHARS],
        "input_ids": list(req.input_ids),
        "sampling_params": req.sampling_params.to_dict(),
        "stream": req.stream,
        "return_logprob": req.return_logprob,
        "logprob_start_len": req.logprob_start_len,
        "top_logprobs_num": req.top_logprobs_num,
        "priority": req.priority,
        "lora_id": req.lora_id,
        "trace_id": req.trace.trace_id if req.trace is not None else None,
    }


def _size(record: dict[str, Any]) -> int:
    """A cheap upper-bound guess of the record's JSON size (ids at most 7 characters each)."""
    return 512 + len(record["input_text"]) * 2 + len(record["input_ids"]) * 8


class CrashDump:
    """A bounded ring of recently received requests; written to `folder` on a crash."""

    def __init__(
        self,
        folder: str,
        server_args: ServerArgs,
        max_requests: int = MAX_DUMP_REQUESTS,
        max_bytes: int = MAX_DUMP_BYTES,
    ) -> None:
        self.folder = folder
        self.server_args = server_args
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._ring: deque[tuple[dict[str, Any], int]] = deque()
        self._bytes = 0
        self.num_dropped = 0  # older requests that left the ring

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> CrashDump | None:
        return cls(args.crash_dump_folder, args) if args.crash_dump_folder else None

    def record(self, reqs: list[Any]) -> None:
        """Keep the generation requests among `reqs` (embedding requests are not replayed)."""
        for req in reqs:
            if not isinstance(req, TokenizedGenerateReqInput):
                continue
            record = request_record(req)
            size = _size(record)
            self._ring.append((record, size))
            self._bytes += size
            while len(self._ring) > self.max_requests or (
                self._bytes > self.max_bytes and len(self._ring) > 1
            ):
                self._bytes -= self._ring.popleft()[1]
                self.num_dropped += 1

    def write(self, reason: str, in_flight: set[str]) -> str | None:
        """Write the dump; the path, or None when nothing was received or writing failed.
        `in_flight`: the rids still running when the child died (marked in the file)."""
        if not self._ring:
            logger.warning("%s; no request was received since start, so no crash dump is written", reason)
            return None
        now = time.time()
        dump = {
            "format": DUMP_FORMAT,
            "version": DUMP_VERSION,
            "reason": reason,
            "written_at": now,
            "num_dropped": self.num_dropped,
            "server_args": json.loads(json.dumps(dataclasses.asdict(self.server_args), default=str)),
            "requests": [{**r, "in_flight": r["rid"] in in_flight} for r, _ in self._ring],
        }
        stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime(now)) + f"_{int(now * 1000) % 1000:03d}"
        name = f"crash_dump_{stamp}_{os.getpid()}.json"
        path = os.path.join(self.folder, name)
        try:
            os.makedirs(self.folder, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(dump, f)
            os.replace(path + ".tmp", path)  # a reader never sees half a file
        except OSError as exc:
            logger.error("Could not write the crash dump to %s: %s", path, exc)
            return None
        logger.error("%s; crash dump of the last %d requests written to %s", reason, len(self._ring), path)
        return path


def write_crash_dump(tm: TokenizerManager, reason: str) -> str | None:
    """A child died: write the TokenizerManager's ring (with --crash-dump-folder). Call it on the
    TokenizerManager's loop, before fail_all forgets which requests were in flight."""
    if tm.crash_dump is None:
        return None
    return tm.crash_dump.write(reason, set(tm.rid_to_state))
