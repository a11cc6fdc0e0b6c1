"""Quality and decode speed of each --kv-cache-dtype against the fp32 KV pool (docs/benchmarks.md).

    python benchmark/bench_kv_dtype.py                    # the built-in model, its server defaults
    python benchmark/bench_kv_dtype.py --dtypes float32 int8 --prompts 4 --new-tokens 64

Per dtype, on the same weights (the model as the server loads it by default):
- perplexity of the fixed text (benchmark/data/quality_text.txt, first --max-tokens tokens), one
  prefill: every position's attention reads its K/V back from the quantized pool;
- greedy agreement: --prompts prompts (slices of the text) decoded --new-tokens greedy tokens in one
  batch; the fraction of positions whose token equals the fp32-KV run's, and the mean index of the
  first differing token (a flip changes the context, so later positions disagree more);
- decode step time at one request with 128 and 2048 tokens of context (median of --steps steps),
  through the fused CPU decode (model_executor/cpu_decode_runner.py), which reads every pool dtype;
  --no-fused compares them on the module forward.
The first dtype is the reference: float32 (fp32 K/V; `auto` is bf16 for the built-in model's GGUF
default on CPU, configs/kv_cache_args.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "quality_text.txt"
CONTEXTS = (128, 2048)


def make_worker(path: str, kv: str, num_tokens: int, no_fused: bool) -> TpModelWorker:
    args = ServerArgs(
        model_path=path,
        max_total_tokens=num_tokens,
        device="cpu",
        kv_cache_dtype=kv,
        disable_cpu_fused_decode=no_fused,
    ).resolve()
    return TpModelWorker(args, ModelConfig.from_path(path, dtype="float32"))


def perplexity(worker: TpModelWorker, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:] from one prefill of ids (the final hidden states through the head)."""
    runner = worker.model_runner
    seen: list[torch.Tensor] = []
    processor = runner.logits_processor

    def record(hidden: torch.Tensor, lm_head: object, fb: object) -> object:
        seen.append(hidden.clone())
        return processor(hidden, lm_head, fb)

    runner.logits_processor = record
    req = StaticReq(list(ids), SamplingParams(max_new_tokens=1, temperature=0.0))
    static = StaticBatchRunner(worker)
    static.prefill([req])
    static.release([req])
    runner.logits_processor = processor
    logits = seen[0][:-1] @ runner.lm_head.weight.detach().T  # [len - 1, vocab]
    nll = -torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    return float(torch.exp(nll.mean()))


def greedy(worker: TpModelWorker, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    reqs = [StaticReq(list(p), SamplingParams(max_new_tokens=new_tokens, temperature=0.0)) for p in prompts]
    static = StaticBatchRunner(worker)
    static.generate(reqs, new_tokens)
    static.release(reqs)
    return [list(r.output_ids) for r in reqs]


def decode_step_ms(worker: TpModelWorker, ids: list[int], context: int, steps: int) -> float:
    """Median wall time of one decode step of one request holding `context` tokens."""
    req = StaticReq(
        (ids * (context // len(ids) + 1))[:context], SamplingParams(max_new_tokens=steps + 4, temperature=0.0)
    )
    static = StaticBatchRunner(worker)
    static.prefill([req])
    static.decode([req])  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        static.decode([req])
        times.append(time.perf_counter() - start)
    static.release([req])
    return statistics.median(times) * 1e3


def agreement(got: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    same = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
    total = sum(len(r) for r in ref)
    first = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) for g, r in zip(got, ref)]
    return same / total, statistics.mean(first)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the built-in model")
    parser.add_argument("--text", default=str(DEFAULT_TEXT))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8"])
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens of the text for perplexity")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per context")
    parser.add_argument(
        "--no-fused",
        action="store_true",
        help="--disable-cpu-fused-decode for every dtype (the module forward's decode)",
    )
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from radixserve.model_loader.default_model import ensure_default_model

    path = args.model_path or str(ensure_default_model(show_progress=False))
    ids = AutoTokenizer.from_pretrained(path).encode(Path(args.text).read_text(encoding="utf-8"))
    text_ids = ids[: args.max_tokens]
    stride = max(1, (len(ids) - args.prompt_len) // max(1, args.prompts))
    prompts = [ids[i * stride : i * stride + args.prompt_len] for i in range(args.prompts)]
    pool_tokens = max(CONTEXTS) + args.max_tokens + args.prompts * (args.prompt_len + args.new_tokens) + 256
    rows, ref_tokens = [], None
    for kv in args.dtypes:
        worker = make_worker(path, kv, pool_tokens, args.no_fused)
        ppl = perplexity(worker, text_ids)
        tokens = greedy(worker, prompts, args.new_tokens)
        ref_tokens = ref_tokens or tokens  # the first dtype (float32) is the reference
        agree, first = agreement(tokens, ref_tokens)
        step_ms = [decode_step_ms(worker, ids, c, args.steps) for c in CONTEXTS]
        per_token = worker.model_runner._kv_bytes_per_token()
        rows.append((kv, per_token, ppl, agree, first, *step_ms))
        print(f"done {kv}: ppl {ppl:.3f} agreement {agree:.3f} step ms {step_ms}", flush=True)
    print(f"\n{len(text_ids)} text tokens; {args.prompts} prompts x {args.new_tokens} greedy tokens\n")
    ctx = " | ".join(f"decode ms @{c}" for c in CONTEXTS)
    print(f"| kv_cache_dtype | KV bytes/token | perplexity | greedy agreement | first flip (mean) | {ctx} |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(CONTEXTS))
    for kv, per_token, ppl, agree, first, *ms in rows:
        cells = " | ".join(f"{m:.2f}" for m in ms)
        print(f"| {kv} | {per_token} | {ppl:.3f} | {agree:.3f} | {first:.1f} | {cells} |")


if __name__ == "__main__":
    main()
