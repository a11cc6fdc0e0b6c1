"""Static-batch latency benchmark without a server: one prefill, then decode steps.

    python -m radixserve.bench_one_batch --batch-size 1 8 32 64 --input-len 128 --output-len 64 --hf
    python -m radixserve.bench_one_batch --batch-size 1 --server-args '{"tp_size": 2}'

Prints SGLang-style result blocks, and appends one JSON line per batch size to --result-file.
With --hf, runs HF transformers `generate` on the same shapes in the same process for comparison.
With tp_size / pp_size > 1 in --server-args, one process per rank runs the same static batch (as
the server's ranks do: same thread split and pinning); rank 0 prints. Pipeline stages run the
batch one stage after the other (a static batch has no micro-batches to overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.static_batch import StaticBatchRunner, StaticReq
from radixserve.model_executor.worker_stack import Worker, build_model_worker
from radixserve.model_loader.default_model import resolve_model_path
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


def _random_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size - 100, (batch_size, input_len), generator=g).tolist()


def bench_radixserve(
    worker: Worker, prompts: list[list[int]], output_len: int, label: str = "radixserve"
) -> dict[str, Any]:
    runner = StaticBatchRunner(worker)
    reqs = [StaticReq(p, SamplingParams(max_new_tokens=output_len, temperature=0.0)) for p in prompts]
    bs, input_len = len(prompts), len(prompts[0])
    start = time.perf_counter()
    runner.prefill(reqs)
    prefill_latency = time.perf_counter() - start
    decode_latencies = []
    for _ in range(output_len - 1):
        tic = time.perf_counter()
        runner.decode(reqs)
        decode_latencies.append(time.perf_counter() - tic)
    total = time.perf_counter() - start
    runner.release(reqs)
    median_decode = statistics.median(decode_latencies)
    return {
        "engine": label,
        "batch_size": bs,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency": prefill_latency,
        "prefill_throughput": bs * input_len / prefill_latency,
        "median_decode_latency": median_decode,
        "median_decode_throughput": bs / median_decode,
        "total_latency": total,
        "overall_throughput": bs * (input_len + output_len) / total,
        "output_throughput": bs * output_len / total,
    }


def bench_hf(model: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    ids = torch.tensor(prompts)
    bs, input_len = ids.shape
    with torch.inference_mode():
        tic = time.perf_counter()
        model(ids)  # a prefill alone, to split prefill from decode time
        prefill_latency = time.perf_counter() - tic
        tic = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
        total = time.perf_counter() - tic
    decode_time = max(total - prefill_latency, 1e-9)
    return {
        "engine": "hf-transformers",
        "batch_size": bs,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency": prefill_latency,
        "prefill_throughput": bs * input_len / prefill_latency,
        "median_decode_latency": decode_time / (output_len - 1),
        "median_decode_throughput": bs * (output_len - 1) / decode_time,
        "total_latency": total,
        "overall_throughput": bs * (input_len + output_len) / total,
        "output_throughput": bs * output_len / total,
    }


def profile_prefill(worker: Worker, prompts: list[list[int]]) -> None:
    """Where one prefill of `prompts` spends its time, op by op (torch profiler, self CPU time)."""
    runner = StaticBatchRunner(worker)
    reqs = [StaticReq(p, SamplingParams(max_new_tokens=1, temperature=0.0)) for p in prompts]
    with torch.profiler.profile() as prof:
        runner.prefill(reqs)
    runner.release(reqs)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


def print_block(r: dict[str, Any]) -> None:
    print(
        f"==== {r['engine']}  batch_size={r['batch_size']} input_len={r['input_len']} output_len={r['output_len']}"
    )
    print(
        f"Prefill. latency: {r['prefill_latency']:.4f} s, throughput: {r['prefill_throughput']:9.2f} token/s"
    )
    print(
        f"Decode.  median latency: {r['median_decode_latency']:.5f} s, "
        f"median throughput: {r['median_decode_throughput']:9.2f} token/s"
    )
    print(
        f"Total. latency: {r['total_latency']:.3f} s, output throughput: {r['output_throughput']:9.2f} token/s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hf", action="store_true", help="also run HF transformers generate")
    parser.add_argument("--result-file", default=None, help="append JSON lines here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile", action="store_true", help="print a torch-profiler table of each batch's prefill"
    )
    parser.add_argument(
        "--server-args",
        default="{}",
        help='ServerArgs fields as JSON, e.g. \'{"attention_backend": "torch_native"}\' or '
        "'{\"cpu_fp16_weights\": true}'",
    )
    args = parser.parse_args(argv)

    model_path = resolve_model_path(args.model_path)
    max_bs = max(args.batch_size)
    server_args = ServerArgs(
        model_path=model_path,
        load_format=args.load_format,
        max_total_tokens=max_bs * (args.input_len + args.output_len) + 64,
        max_running_requests=max_bs,
        **json.loads(args.server_args),
    ).resolve()
    if not server_args.layout().is_single:
        if args.hf or args.profile:
            parser.error("--hf and --profile run on a single rank only")
        _run_ranks(server_args, args)
        return
    torch.set_num_threads(server_args.cpu_threads or torch.get_num_threads())
    run_benchmarks(server_args, args, build_model_worker(server_args, _model_config(server_args)))


def _model_config(server_args: ServerArgs) -> ModelConfig:
    return ModelConfig.from_path(server_args.model_path, dtype=server_args.dtype, device=server_args.device)


def _run_ranks(server_args: ServerArgs, args: argparse.Namespace) -> None:
    """One process per rank, placed like the server's ranks; rank 0 prints and writes results."""
    import multiprocessing as mp

    from radixserve.entrypoints.subprocesses import check_model_layout
    from radixserve.utils.network import get_free_port

    check_model_layout(server_args)
    init_addr = f"127.0.0.1:{get_free_port()}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_bench_rank, args=(server_args, args, rank, init_addr))
        for rank in range(server_args.layout().world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise SystemExit(f"ranks {failed} failed")


def _bench_rank(server_args: ServerArgs, args: argparse.Namespace, rank: int, init_addr: str) -> None:
    from radixserve.distributed.rank_runtime import RankRuntime
    from radixserve.scheduler.scheduler_process import place_rank

    layout = server_args.layout()
    device, threads, cores = place_rank(server_args, layout, layout.rank_info(rank).local_rank)
    runtime = RankRuntime.for_server(server_args, rank, init_addr, device)
    worker = build_model_worker(server_args, _model_config(server_args), runtime, device)
    if rank == 0:
        print(
            f"{layout.world_size} ranks (tp {layout.tp_size} x pp {layout.pp_size}), {threads} thread(s) each"
        )
    gloo = runtime.parallel.tp.fast is None and server_args.tp_size > 1
    run_benchmarks(server_args, args, worker, quiet=rank != 0, gloo=gloo)


def run_benchmarks(
    server_args: ServerArgs, args: argparse.Namespace, worker: Worker, quiet: bool = False, gloo: bool = False
) -> None:
    model_config = worker.model_config
    model_path = server_args.model_path
    hf_model = None
    if args.hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    # The label says what differs from the defaults, so A/B rows (docs/benchmarks.md) tell apart.
    label = "radixserve" + (f" {args.server_args}" if json.loads(args.server_args) else "")
    if gloo:  # TP ranks all-reduce over gloo (no shared-memory communicator)
        label += " [gloo all-reduce]"
    if os.environ.get("RADIXSERVE_DISABLE_CPU_KERNELS", "0") not in ("", "0"):
        label += " [compiled CPU kernels off]"
    # Warm-up so one-time costs (allocator growth, lazy init) are not timed.
    bench_radixserve(worker, _random_prompts(2, 16, model_config.vocab_size, args.seed), 4)
    results = []
    for bs in args.batch_size:
        prompts = _random_prompts(bs, args.input_len, model_config.vocab_size, args.seed + bs)
        if args.profile:
            profile_prefill(worker, prompts)
        results.append(bench_radixserve(worker, prompts, args.output_len, label))
        if quiet:
            continue
        print_block(results[-1])
        if hf_model is not None:
            results.append(bench_hf(hf_model, prompts, args.output_len))
            print_block(results[-1])
    if args.result_file and not quiet:
        with open(args.result_file, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
