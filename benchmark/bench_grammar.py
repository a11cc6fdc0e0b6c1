"""Cost of constrained decoding.

1. Per step, at batch 1 / 16 / 64 with every row constrained and with one row constrained: filling
   the grammar mask (xgrammar bitmask + unpacking the constrained rows to bool) and applying it to
   the logits (what Sampler does with vocab_mask, including its copy of the logits).
2. Decode throughput of the scheduler per request mix (share with a grammar, share with a
   penalty) and loop: in the overlap loop such batches sample delayed (seed 001 §2.2).

    python benchmark/bench_grammar.py                   # the built-in model (real vocab)
    python benchmark/bench_grammar.py --model /path/to/model --decode-batch 16 --max-new-tokens 64
    python benchmark/bench_grammar.py --decode-only --loops normal,overlap --mixes free,json50,json100,json50+penalty50
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.constrained.grammar_backend import GrammarBackend
from radixserve.constrained.grammar_manager import GrammarManager
from radixserve.testing.inprocess import InProcessScheduler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}


@dataclass
class _Row:
    """What GrammarManager.vocab_mask reads from a request."""

    grammar: Any


def bench_mask(model: str, batch_sizes: list[int], iters: int) -> None:
    from transformers import AutoTokenizer

    from radixserve.configs.model_config import ModelConfig

    config = ModelConfig.from_path(model)
    vocab = config.vocab_size
    backend = GrammarBackend(AutoTokenizer.from_pretrained(model), vocab, config.eos_token_ids)
    compiled = backend.get_cached_or_future_value(("json", json.dumps(SCHEMA)))[0].result()
    manager = GrammarManager(lambda: backend, 300.0, lambda r: None, lambda r, m, c: None)
    print(f"vocab={vocab}")
    print("| batch | constrained rows | fill mask (ms) | apply mask (ms) | total per step (ms) |")
    print("|---|---|---|---|---|")
    for bs in batch_sizes:
        for constrained in sorted({bs, 1}, reverse=True):
            rows = [
                _Row(_mid_string_matcher(backend, compiled) if i < constrained else None) for i in range(bs)
            ]
            logits = torch.randn(bs, vocab)
            fill = _timed(lambda rows=rows: manager.vocab_mask(rows, vocab), iters)  # noqa: B023
            mask = manager.vocab_mask(rows, vocab)
            apply = _timed(lambda lg=logits, m=mask: m.apply_(lg.clone()), iters)  # noqa: B023
            print(f"| {bs} | {constrained} | {fill:.3f} | {apply:.3f} | {fill + apply:.3f} |")
    backend.shutdown()


def _mid_string_matcher(backend: GrammarBackend, compiled: Any) -> Any:  # noqa: ANN401
    matcher = backend.new_matcher(compiled)
    matcher.accept_string('{"name": "Ada Lovelace", "age": 36, "tags": ["math')  # mid-string
    return matcher


def _timed(fn: Any, iters: int) -> float:  # noqa: ANN401
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


# Request mixes for the decode benchmark: the share of requests with a grammar, with a penalty.
MIXES = {
    "free": (0.0, 0.0),
    "json50": (0.5, 0.0),
    "json100": (1.0, 0.0),
    "json50+penalty50": (0.5, 0.5),
}


def bench_decode(
    model: str, batch: int, max_new_tokens: int, loops: list[str], mixes: list[str], repeats: int
) -> None:
    """Decode of `batch` requests per mix and loop: one untimed pass of every mix in every loop
    first (it warms the grammar cache and every batch shape the runs go through), then `repeats`
    rounds, each running every (loop, mix) once in turn, so drifting load from other processes
    hits every row alike; the best run of each row counts (the least disturbed). In the overlap
    loop a batch with grammars or penalties samples delayed (its forward overlaps with processing
    the previous batch); before delayed sampling it ran without any overlap."""
    print(f"\ndecode: batch {batch}, {max_new_tokens} new tokens, best of {repeats} interleaved rounds")
    scheds = {
        loop: InProcessScheduler(
            model,
            max_total_tokens=16384,
            max_running_requests=batch,
            disable_overlap_schedule=loop == "normal",
        )
        for loop in loops
    }
    runs: dict[tuple[str, str], list[tuple[int, float]]] = {
        (loop, mix): [] for loop in loops for mix in mixes
    }
    for round_ in range(repeats + 1):  # round 0 warms up
        for mix in mixes:
            for loop, sched in scheds.items():
                run = _run_mix(sched, mix, batch, max_new_tokens)
                if round_:
                    runs[(loop, mix)].append(run)
    print("| mix (grammar, penalty) | loop | tokens | best (s) | tokens/s | median (s) |")
    print("|---|---|---|---|---|---|")
    for mix in mixes:
        grammar_share, penalty_share = MIXES[mix]
        shares = f"{int(grammar_share * 100)}%, {int(penalty_share * 100)}%"
        for loop in loops:
            tokens, best = min(runs[(loop, mix)], key=lambda r: r[1])
            median = sorted(r[1] for r in runs[(loop, mix)])[len(runs[(loop, mix)]) // 2]
            print(
                f"| {mix} ({shares}) | {loop} | {tokens} | {best:.2f} | {tokens / best:.1f} | {median:.2f} |"
            )
    for sched in scheds.values():
        sched.close()


def _run_mix(sched: InProcessScheduler, mix: str, batch: int, max_new_tokens: int) -> tuple[int, float]:
    """(tokens generated, seconds) for one batch of the mix, run to completion."""
    grammar_share, penalty_share = MIXES[mix]
    schema = json.dumps(SCHEMA)
    prompt = sched.tokenizer.encode("Describe a person as JSON:")
    sched.results.clear()
    for i in range(batch):
        extra: dict[str, Any] = {"json_schema": schema} if i < batch * grammar_share else {"ignore_eos": True}
        if i >= batch * (1 - penalty_share):
            extra["frequency_penalty"] = 0.3
        sched.submit(f"{mix}-{i}", prompt, max_new_tokens=max_new_tokens, **extra)
    start = time.perf_counter()
    results = sched.run_until_idle()
    return sum(len(r.output_ids) for r in results.values()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--loops", default="overlap", help="comma-separated: normal, overlap")
    parser.add_argument("--mixes", default="free,json50", help=f"comma-separated, of {', '.join(MIXES)}")
    parser.add_argument("--decode-only", action="store_true", help="skip the per-step mask timings")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed rounds (the best run of each row counts)"
    )
    args = parser.parse_args()
    model = args.model
    if model is None:
        from radixserve.model_loader.default_model import ensure_default_model

        model = ensure_default_model()
    print(f"torch threads: {torch.get_num_threads()}")
    if not args.decode_only:
        bench_mask(model, [int(b) for b in args.batch_sizes.split(",")], args.iters)
    loops, mixes = args.loops.split(","), args.mixes.split(",")
    bench_decode(model, args.decode_batch, args.max_new_tokens, loops, mixes, args.repeats)


if __name__ == "__main__":
    main()
