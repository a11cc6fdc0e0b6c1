"""A model of the scheduler's order for compare_peers' closed loop: C clients, each sending its next
prompt when its previous request finishes, N requests in all, every prompt IN tokens and every
output OUT tokens (the long cell: 2048 / 128, C=8, 16 prompts). It prints the median TTFT and the
output tok/s of SGLang's schedules with measured step costs, so the order's effect can be sized
without a quiet machine (the served runs that check it are in docs/benchmarks.md).

    python benchmark/schedule_model.py
    python benchmark/schedule_model.py --prefill-ms-per-token 0.78 --decode-ms 8 --decode-ms-per-req 5.3

Steps follow batch_builder: prefill first whenever a prompt waits, chunks of --chunked-prefill-size
tokens filled from the queue in order (a prompt's tail shares the next chunk with the next prompt);
without mixing, decodes wait; with --enable-mixed-chunk the running decodes ride in each chunk and
take one token each of its budget (SGLang's PrefillAdder). A chunk costs its tokens x
prefill-ms-per-token (+ decode-ms-per-req per riding decode); a decode step decode-ms + decode-ms-per-req
x batch. Defaults: quiet Zen 4 (2 cores) figures, a 2048-token prompt 1.6 s, a step of 8 at ~2k context
~50 ms.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass


@dataclass
class Request:
    arrival: float
    left: int  # prompt tokens not yet prefilled
    output: int = 0
    ttft: float | None = None


@dataclass(frozen=True)
class Costs:
    prefill_ms_per_token: float
    decode_ms: float
    decode_ms_per_req: float


@dataclass(frozen=True)
class Workload:
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int


def prefill_step(waiting: list[Request], budget: int) -> tuple[list[Request], int]:
    """Fill one chunk from the queue in order: (the requests it touches, its tokens)."""
    touched, tokens = [], 0
    for req in waiting:
        if budget <= 0:
            break
        take = min(req.left, budget)
        req.left -= take
        budget -= take
        tokens += take
        touched.append(req)
    return touched, tokens


def simulate(w: Workload, c: Costs, chunk: int, mixed: bool) -> tuple[float, float]:
    """(median TTFT in ms, output tok/s) of one run."""
    now, issued = 0.0, w.concurrency
    waiting = [Request(0.0, w.input_len) for _ in range(w.concurrency)]
    running: list[Request] = []
    finished: list[Request] = []
    while len(finished) < w.num_prompts:
        if waiting:
            touched, tokens = prefill_step(waiting, chunk - (len(running) if mixed else 0))
            riders = running if mixed else []
            now += (tokens * c.prefill_ms_per_token + c.decode_ms_per_req * len(riders)) / 1e3
        else:
            touched, riders = [], running
            now += (c.decode_ms + c.decode_ms_per_req * len(running)) / 1e3
        for req in riders:
            req.output += 1
        for req in touched:
            if req.left == 0:
                waiting.remove(req)
                req.ttft, req.output = now - req.arrival, 1
                running.append(req)
        for req in [r for r in running if r.output >= w.output_len]:
            running.remove(req)
            finished.append(req)
            if issued < w.num_prompts:  # the client sends its next prompt at once
                issued += 1
                waiting.append(Request(now, w.input_len))
    ttfts = [r.ttft for r in finished if r.ttft is not None]
    return 1e3 * statistics.median(ttfts), w.num_prompts * w.output_len / now


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.78)
    p.add_argument("--decode-ms", type=float, default=8.0)
    p.add_argument("--decode-ms-per-req", type=float, default=5.3)
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    args = p.parse_args()
    w = Workload(args.concurrency, args.num_prompts, args.input_len, args.output_len)
    c = Costs(args.prefill_ms_per_token, args.decode_ms, args.decode_ms_per_req)
    print(f"{'chunked_prefill_size':>20} {'mixed':>6} {'median TTFT ms':>15} {'output tok/s':>13}")
    for chunk in args.chunks:
        for mixed in (False, True):
            ttft, tput = simulate(w, c, chunk, mixed)
            print(f"{chunk:>20} {str(mixed):>6} {ttft:>15.0f} {tput:>13.1f}")


if __name__ == "__main__":
    main()
