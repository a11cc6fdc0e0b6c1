"""Peak memory of loading a GGUF model in-process, the way a server rank does (docs/models.md,
"GGUF MoE memory"): resolve the server args (which converts the file on first use), then build the
TP worker (model, quantized forms, KV pool). Prints the peak RSS after each phase, the RSS once
loaded, and the conversion folder's size on disk.

    RADIXSERVE_CACHE_DIR=$(mktemp -d) python scripts/measure_gguf_load.py model.gguf [--quantization unquant]

Point RADIXSERVE_CACHE_DIR at an empty folder to include the conversion; run it again for a load
from the cached conversion. Peak RSS is the process's own (getrusage), so run one load per process.
RSS counts the pages of files the process maps (the safetensors folder, the GGUF) as well as its
own memory: a thread samples /proc/self/status every 5 ms for the peak of each (RssAnon: what the
load needs; RssFile: mapped file pages, page cache the kernel can take back under pressure).
"""

from __future__ import annotations

import argparse
import json
import resource
import threading
import time
from pathlib import Path

_peaks = {"RssAnon": 0, "RssFile": 0}


def _sample() -> None:
    while True:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in _peaks:
                    _peaks[key] = max(_peaks[key], int(line.split()[1]))
        time.sleep(0.005)


def _sampled() -> str:
    return ", ".join(f"peak {k} {v / 2**20:.2f} GiB" for k, v in _peaks.items())


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def _folder_gib(folder: str) -> float:
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file()) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--quantization", default=None, help="e.g. unquant (default: the file's, gguf)")
    parser.add_argument("--max-total-tokens", type=int, default=4096)
    parser.add_argument(
        "--server-args",
        default="{}",
        help="more ServerArgs as JSON, e.g. '{\"disable_cpu_wq_int8_activations\": true}'",
    )
    args = parser.parse_args()
    threading.Thread(target=_sample, daemon=True).start()

    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.tp_worker import TpModelWorker
    from radixserve.server_args import ServerArgs

    start = time.perf_counter()
    server_args = ServerArgs(
        model_path=args.gguf,
        device="cpu",
        quantization=args.quantization,
        max_total_tokens=args.max_total_tokens,
        log_level="warning",
        **json.loads(args.server_args),
    ).resolve()
    folder = server_args.model_path
    print(
        f"resolve (conversion if not cached): {time.perf_counter() - start:.1f} s, peak RSS "
        f"{_peak_gib():.2f} GiB ({_sampled()})"
    )
    print(f"conversion folder {folder}: {_folder_gib(folder):.2f} GiB on disk")
    start = time.perf_counter()
    config = ModelConfig.from_path(folder, dtype="float32")  # what --quantization gguf serves
    worker = TpModelWorker(server_args, config)
    print(
        f"load: {time.perf_counter() - start:.1f} s, peak RSS {_peak_gib():.2f} GiB ({_sampled()}), "
        f"RSS once loaded {_rss_gib():.2f} GiB"
    )
    _print_experts(worker)


def _print_experts(worker: object) -> None:
    """What holds a MoE's experts once loaded: their path and resident bytes."""
    from radixserve.layers.cpu_crossovers import active
    from radixserve.layers.moe.layer import FusedMoE

    print(f"crossovers: {active().describe()}")
    wq = [m.experts_wq for m in worker.model_runner.model.modules() if isinstance(m, FusedMoE)]
    wq = [w for w in wq if w is not None]
    if wq:
        on_panels = sum(w.w13_panels is not None for w in wq)
        print(
            f"experts: {len(wq)} quantized MoE layers, {on_panels} on int8-activation panels "
            f"(moe_a8={active().moe_a8}), {sum(w.nbytes() for w in wq) / 2**30:.3f} GiB resident"
        )


if __name__ == "__main__":
    main()
