"""Replay a --crash-dump-folder dump against a running server, to reproduce the crash.

    python scripts/replay_crash_dump.py DUMP.json --url http://127.0.0.1:30000 [--speed 1] [--api-key K]

Each request of the dump is sent to /generate as the scheduler received it (its token ids and
sampling params, non-streaming), at its original offset from the first one divided by --speed
(--speed 0: all at once, in order), each on its own thread, so requests that overlapped before
overlap again. One JSON line per request (rid, HTTP status or the connection error, seconds), then
a summary line; the exit status is 1 when any request failed (the server died or refused it), else
0. Only the standard library is needed, so the script runs wherever the dump was copied to.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

DUMP_FORMAT = "radixserve-crash-dump"  # managers/crash_dump.py
FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "priority")


def load_dump(path: str) -> dict[str, Any]:
    with open(path) as f:
        dump = json.load(f)
    if dump.get("format") != DUMP_FORMAT:
        raise SystemExit(f"{path} is not a radixserve crash dump (format {dump.get('format')!r})")
    return dump


def generate_body(record: dict[str, Any]) -> dict[str, Any]:
    """The /generate body of one dumped request: ids (what the scheduler ran), not the text."""
    body = {
        "rid": record["rid"],
        "input_ids": record["input_ids"],
        "sampling_params": record["sampling_params"],
    }
    body.update({k: record[k] for k in FIELDS if record.get(k) is not None})
    return body


def send(url: str, body: dict[str, Any], api_key: str | None, timeout: float) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), headers)
    start = time.monotonic()
    result: dict[str, Any] = {"rid": body["rid"]}
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            result["status"] = resp.status
            meta = json.loads(resp.read()).get("meta_info", {})
            result["finish_reason"] = meta.get("finish_reason")
    except urllib.error.HTTPError as exc:
        result["status"] = exc.code
        result["error"] = exc.read().decode(errors="replace")[:500]
    except (OSError, urllib.error.URLError) as exc:  # refused, reset, timed out: the server is gone
        result["status"] = None
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["seconds"] = round(time.monotonic() - start, 3)
    return result


def replay(dump: dict[str, Any], url: str, speed: float, api_key: str | None, timeout: float) -> list[dict]:
    """Send every request at its offset; the results in the dump's order."""
    records = sorted(dump["requests"], key=lambda r: r["received_time"])
    results: list[dict[str, Any] | None] = [None] * len(records)
    t0, start = (records[0]["received_time"] if records else 0.0), time.monotonic()

    def run(i: int, record: dict[str, Any]) -> None:
        results[i] = send(url, generate_body(record), api_key, timeout)

    threads = []
    for i, record in enumerate(records):
        if speed > 0:
            time.sleep(max(0.0, (record["received_time"] - t0) / speed - (time.monotonic() - start)))
        thread = threading.Thread(target=run, args=(i, record), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout + 5)
    return [
        r or {"rid": rec["rid"], "status": None, "error": "no answer"} for r, rec in zip(results, records)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dump", help="a crash_dump_*.json file")
    parser.add_argument(
        "--url", required=True, help="the server to replay against, e.g. http://127.0.0.1:30000"
    )
    parser.add_argument("--speed", type=float, default=1.0, help="time scale; 0 sends all at once")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    args = parser.parse_args(argv)
    dump = load_dump(args.dump)
    print(f"# {len(dump['requests'])} requests; the dump says: {dump.get('reason')}", file=sys.stderr)
    results = replay(dump, args.url.rstrip("/"), args.speed, args.api_key, args.timeout)
    for result in results:
        print(json.dumps(result))
    failed = [r["rid"] for r in results if r["status"] != 200]
    print(json.dumps({"num_requests": len(results), "num_failed": len(failed), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
