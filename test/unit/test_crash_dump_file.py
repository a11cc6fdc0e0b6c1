"""The crash dump's ring (bounded in requests and bytes) and its JSON file."""

from __future__ import annotations

import json
import os

from radixserve.managers.crash_dump import DUMP_FORMAT, CrashDump
from radixserve.managers.io_struct import TokenizedEmbeddingReqInput, TokenizedGenerateReqInput, TraceContext
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


def _req(rid: str, n: int = 4, text: str = "", **kw) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid, text, list(range(n)), SamplingParams(max_new_tokens=3), **kw)


def test_ring_keeps_the_newest_within_its_request_and_byte_bounds(tmp_path) -> None:
    args = ServerArgs(model_path="/m", crash_dump_folder=str(tmp_path))
    dump = CrashDump(str(tmp_path), args, max_requests=5, max_bytes=10**9)
    dump.record([_req(f"r{i}") for i in range(8)])
    dump.record([TokenizedEmbeddingReqInput("e", "", [1, 2])])  # not replayed, not kept
    assert [r["rid"] for r, _ in dump._ring] == ["r3", "r4", "r5", "r6", "r7"] and dump.num_dropped == 3
    small = CrashDump(str(tmp_path), args, max_requests=100, max_bytes=20_000)
    small.record([_req(f"big{i}", n=1000) for i in range(5)])  # ~8 kB each by the estimate
    assert [r["rid"] for r, _ in small._ring] == ["big3", "big4"]
    lone = CrashDump(str(tmp_path), args, max_requests=100, max_bytes=10)
    lone.record([_req("huge", n=5000)])  # one request over the cap is still kept
    assert [r["rid"] for r, _ in lone._ring] == ["huge"]


def test_written_file_is_json_with_args_inputs_and_in_flight_marks(tmp_path) -> None:
    folder = str(tmp_path / "dumps")
    args = ServerArgs(model_path="/m", crash_dump_folder=folder)
    dump = CrashDump.from_server_args(args)
    assert dump is not None and CrashDump.from_server_args(ServerArgs(model_path="/m")) is None
    assert dump.write("scheduler died", set()) is None  # nothing received: nothing to write
    trace = TraceContext("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    dump.record([_req("a", text="hello"), _req("b", trace=trace, stream=True)])
    path = dump.write("scheduler died (exit code 1)", {"b"})
    assert path is not None and os.path.dirname(path) == folder
    with open(path) as f:
        data = json.load(f)
    assert data["format"] == DUMP_FORMAT and data["reason"] == "scheduler died (exit code 1)"
    assert data["server_args"]["model_path"] == "/m"
    a, b = data["requests"]
    assert (a["rid"], a["input_text"], a["input_ids"], a["in_flight"]) == ("a", "hello", [0, 1, 2, 3], False)
    assert a["sampling_params"]["max_new_tokens"] == 3 and a["trace_id"] is None
    assert b["in_flight"] and b["stream"] and b["trace_id"] == trace.trace_id
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]


def test_an_unwritable_folder_logs_and_returns_none(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = ServerArgs(model_path="/m")
    dump = CrashDump(str(blocker / "sub"), args)
    dump.record([_req("a")])
    assert dump.write("died", set()) is None
