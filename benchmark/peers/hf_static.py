"""The HF transformers baseline: static batches through `generate`, fp32, greedy, EOS ignored.

There is no server and no streaming: B random prompts go in together and all B finish together,
so the only numbers are the batch's wall time and what follows from it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def random_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    # Ids away from both ends of the vocabulary: the specials of SmolLM2 sit at the start.
    return torch.randint(100, vocab_size - 100, (batch_size, input_len), generator=g)  # [B, input_len]


def run_static_batches(
    model_dir: Path,
    batch_sizes: Sequence[int],
    input_len: int,
    output_len: int,
    threads: int = 2,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One result per batch size (see peers.report for the keys); one warm-up batch is not timed."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vocab_size = int(model.config.vocab_size)
    pad_id = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

    def generate(ids: Any, num_new: int) -> float:
        tic = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_new,
                min_new_tokens=num_new,  # EOS suppressed: every row yields exactly num_new tokens
                do_sample=False,
                pad_token_id=pad_id,
            )
        return time.perf_counter() - tic

    generate(random_prompts(1, min(input_len, 16), vocab_size, seed), 4)  # one-time init costs
    results = []
    for bs in batch_sizes:
        elapsed = generate(random_prompts(bs, input_len, vocab_size, seed + bs), output_len)
        print(f"[hf] batch {bs}: {elapsed:.2f} s, {bs * output_len / elapsed:.1f} output tok/s", flush=True)
        results.append(
            {
                "engine": "hf",
                "workload": "static-batch",
                "workload_desc": f"static batch {input_len}→{output_len}",
                "concurrency": bs,
                "num_prompts": bs,
                "completed": bs,
                "failed": 0,
                "duration_s": elapsed,
                "request_throughput": bs / elapsed,
                "output_throughput": bs * output_len / elapsed,
                "median_ttft_ms": None,
                "p99_ttft_ms": None,
                "median_tpot_ms": None,
                "p99_tpot_ms": None,
                "median_e2e_latency_ms": elapsed * 1000.0,
                "seed": seed + bs,
                "threads": threads,
            }
        )
    return results
