"""CPU time per streamed SSE chunk in the HTTP server process: uvicorn's h11 protocol against
httptools (what uvicorn's "auto" takes when httptools is installed).

    python benchmark/bench_http_chunk_send.py                  # 20000 chunks, 3 rounds alternating

A Starlette app streams small chunks (the size of one /generate chunk), one per 0.5 ms as one
stream does; a server process runs it under each protocol in turn and the server's CPU time
(/proc/<pid>/stat, all threads) over one streaming request is divided by the chunks. CPU time,
not wall time: it holds on a loaded machine.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import time
import urllib.request

CHUNK = b'data: {"text": "' + b"x" * 300 + b'", "output_ids": [1, 2, 3], "meta_info": {}}\n\n'


def _serve(port: int, http: str, chunks: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def stream(_: object) -> StreamingResponse:
        async def gen() -> object:
            for _ in range(chunks):
                await asyncio.sleep(0.0005)
                yield CHUNK

        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/s", stream)])
    uvicorn.run(app, host="127.0.0.1", port=port, http=http, loop="uvloop", log_level="warning")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _round(http: str, chunks: int) -> float:
    port = _free_port()
    proc = mp.get_context("spawn").Process(target=_serve, args=(port, http, chunks), daemon=True)
    proc.start()
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/nothing", timeout=1)
            except urllib.error.HTTPError:
                break  # a 404: the server answers
            except OSError:
                time.sleep(0.1)
        start = _cpu_s(proc.pid)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/s", timeout=120) as r:
            got = sum(1 for line in r if line.startswith(b"data:"))
        used = _cpu_s(proc.pid) - start
        assert got == chunks, (got, chunks)
        return used / chunks
    finally:
        proc.terminate()
        proc.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for r in range(args.rounds):
        line = [f"{http} {_round(http, args.chunks) * 1e6:.0f} us/chunk" for http in ("h11", "httptools")]
        print(f"round {r}: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
