"""Cost of constrained decoding.

1. Per step, at batch 1 / 16 / 64 with every row constrained and with one row constrained: filling
   the grammar mask (xgrammar bitmask + unpacking the constrained rows to bool) and applying it to
   the logits (what Sampler does with vocab_mask, including its copy of the logits).
2. Decode throughput of the scheduler with 50% constrained requests vs none.

    python benchmark/bench_grammar.py                   # the built-in model (real vocab)
    python benchmark/bench_grammar.py --model /path/to/model --decode-batch 16 --max-new-tokens 64
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


def bench_decode(model: str, batch: int, max_new_tokens: int, overlap: bool) -> None:
    print(f"\ndecode: batch {batch}, {max_new_tokens} new tokens, overlap={overlap}")
    print("| constrained | tokens | seconds | tokens/s |")
    print("|---|---|---|---|")
    for fraction in (0.0, 0.5):
        sched = InProcessScheduler(
            model, max_total_tokens=16384, max_running_requests=batch, disable_overlap_schedule=not overlap
        )
        prompt = sched.tokenizer.encode("Describe a person as JSON:")
        schema = json.dumps(SCHEMA)
        # Warm up the compile cache and the model so the timing is steady-state decode.
        sched.submit("warm", prompt, max_new_tokens=2, json_schema=schema)
        sched.run_until_idle()
        sched.results.clear()
        for i in range(batch):
            constrained = i < batch * fraction
            extra = {"json_schema": schema} if constrained else {"ignore_eos": True}
            sched.submit(f"r{i}", prompt, max_new_tokens=max_new_tokens, **extra)
        start = time.perf_counter()
        results = sched.run_until_idle()
        elapsed = time.perf_counter() - start
        tokens = sum(len(r.output_ids) for r in results.values())
        print(f"| {int(fraction * 100)}% | {tokens} | {elapsed:.2f} | {tokens / elapsed:.1f} |")
        sched.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--disable-overlap", action="store_true")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from radixserve.model_loader.default_model import ensure_default_model

        model = ensure_default_model()
    print(f"torch threads: {torch.get_num_threads()}")
    bench_mask(model, [int(b) for b in args.batch_sizes.split(",")], args.iters)
    bench_decode(model, args.decode_batch, args.max_new_tokens, overlap=not args.disable_overlap)


if __name__ == "__main__":
    main()
