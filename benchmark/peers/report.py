"""The compare_peers report: a markdown table between markers in docs/benchmarks.md, and PNG plots.

A result is one flat dict per (engine, workload, concurrency), as written to the JSONL file:
`engine`, `workload` ("random", "shared-prefix" or "static-batch"), `workload_desc` (what the
table shows), `concurrency` (the batch size for static batches), `num_prompts`, `completed`,
`failed`, and the metrics named in COLUMNS. Latency metrics are None where an engine has none
(a static batch has no per-request TTFT or TPOT).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BEGIN_MARKER = "<!-- compare_peers:begin -->"
END_MARKER = "<!-- compare_peers:end -->"
SECTION_TITLE = "## Side by side with llama.cpp and HF transformers"
PLOT_FILES = {
    "throughput": "compare_peers_throughput.png",
    "ttft": "compare_peers_ttft.png",
    "tpot": "compare_peers_tpot.png",
}
# (header, result key, format)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("req/s", "request_throughput", "{:.2f}"),
    ("output tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50 (ms)", "median_ttft_ms", "{:.0f}"),
    ("TTFT p99 (ms)", "p99_ttft_ms", "{:.0f}"),
    ("TPOT p50 (ms)", "median_tpot_ms", "{:.1f}"),
    ("TPOT p99 (ms)", "p99_tpot_ms", "{:.1f}"),
    ("E2E p50 (ms)", "median_e2e_latency_ms", "{:.0f}"),
)
WORKLOAD_ORDER = {"random": 0, "static-batch": 1, "shared-prefix": 2}


def _cell(value: Any, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def _requests_cell(r: dict[str, Any]) -> str:
    failed = r.get("failed") or 0
    return f"{r['num_prompts']}" if not failed else f"{r['num_prompts']} ({failed} failed)"


def median_runs(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per (engine, workload, concurrency): the run with the median output throughput
    (the lower middle one for an even count), annotated with `runs` and the throughput range.
    Whole runs are kept, not per-metric medians, so every row is a set of numbers that happened."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["engine"], r["workload"], r["concurrency"]), []).append(r)
    picked = []
    for runs in groups.values():
        ranked = sorted(runs, key=lambda r: r.get("output_throughput") or 0.0)
        tps = [r.get("output_throughput") or 0.0 for r in ranked]
        picked.append(
            {**ranked[(len(ranked) - 1) // 2], "runs": len(ranked), "output_range": (tps[0], tps[-1])}
        )
    return picked


def _throughput_cell(r: dict[str, Any]) -> str:
    cell = _cell(r.get("output_throughput"), "{:.1f}")
    if r.get("runs", 1) > 1:
        low, high = r["output_range"]
        cell += f" ({low:.0f}–{high:.0f})"
    return cell


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per result, grouped by workload, then engine in first-seen order, then concurrency."""
    engine_order = {e: i for i, e in enumerate(dict.fromkeys(r["engine"] for r in results))}
    rows = sorted(
        results,
        key=lambda r: (WORKLOAD_ORDER.get(r["workload"], 9), engine_order[r["engine"]], r["concurrency"]),
    )
    header = ["engine", "workload", "concurrency", "requests", *(c[0] for c in COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for r in rows:
        cells = [r["engine"], r["workload_desc"], str(r["concurrency"]), _requests_cell(r)]
        cells += [
            _throughput_cell(r) if key == "output_throughput" else _cell(r.get(key), fmt)
            for _, key, fmt in COLUMNS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine_description(repo_root: Path, llama_cpp_desc: str | None) -> list[str]:
    """nproc, CPU model and vector ISA, memory, date, and the versions of what was compared."""
    cpu_model, mem = platform.processor() or "unknown CPU", ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        for line in cpuinfo:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
        # Both engines compile for the machine they run on, so the widest vector ISA matters.
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
        isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
        cpu_model += f" ({isa})" if isa else ""
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal"))
        mem = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    git = ["git", "-C", str(repo_root), "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True).stdout.strip() or "unknown commit"
    import torch
    import transformers

    parts = [
        f"{nproc} cores (nproc), {cpu_model}{mem}",
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"radixserve {commit}, torch {torch.__version__}, transformers {transformers.__version__}",
    ]
    return parts + ([llama_cpp_desc] if llama_cpp_desc else [])


def render_block(
    results: Sequence[dict[str, Any]], command: str, machine: Sequence[str], notes: Sequence[str] = ()
) -> str:
    """The generated part of the section (without the markers): paragraphs, the table, the plots.
    Repeated runs are reduced to their median run (median_runs)."""
    results = median_runs(results)
    paragraphs = [
        "Generated by `benchmark/compare_peers.py`; do not edit by hand.",
        f"Command: `{command}`",
        "Machine: " + "; ".join(machine) + ".",
        format_table(results),
    ]
    runs = max((r["runs"] for r in results), default=1)
    if runs > 1:
        paragraphs.append(
            f"Each row is the median of {runs} runs by output throughput (the runs went round-robin "
            "over the engines, each with a fresh server); the range of the runs' output tok/s is in "
            "parentheses, the other columns come from the median run."
        )
    if any(r["workload"] == "static-batch" for r in results):
        paragraphs.append(
            "The `hf` rows are static batches (`generate` on B prompts at once, EOS ignored): "
            "concurrency is the batch size, req/s and output tok/s are B and B × output length over "
            "the batch's wall time, and E2E is that wall time. A static batch streams nothing, so it "
            "has no TTFT or TPOT percentiles (—)."
        )
    paragraphs += notes
    paragraphs.append(" ".join(f"![{name}](img/{file})" for name, file in PLOT_FILES.items()))
    return "\n\n".join(paragraphs)


def replace_block(text: str, block: str) -> str:
    """`text` with the marked block replaced by `block`, or a new section with it appended."""
    wrapped = f"{BEGIN_MARKER}\n{block.strip()}\n{END_MARKER}"
    begin, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if begin != -1 and end > begin:
        return text[:begin] + wrapped + text[end + len(END_MARKER) :]
    if begin != -1 or end != -1:
        raise ValueError(f"unbalanced {BEGIN_MARKER} / {END_MARKER} markers; fix the file by hand")
    return text.rstrip("\n") + f"\n\n{SECTION_TITLE}\n\n{wrapped}\n"


def update_doc(path: Path, block: str) -> None:
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(replace_block(text, block), encoding="utf-8")


def _series(
    results: Sequence[dict[str, Any]], workloads: tuple[str, ...], key: str
) -> dict[str, tuple[list[int], list[float]]]:
    """engine -> (concurrencies, values), sorted by concurrency; results without `key` are skipped."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in sorted(results, key=lambda r: r["concurrency"]):
        if r["workload"] not in workloads or r.get(key) is None:
            continue
        xs, ys = out.setdefault(r["engine"], ([], []))
        xs.append(r["concurrency"])
        ys.append(float(r[key]))
    return out


def _finish_axes(ax: Any, xs: set[int], title: str, ylabel: str, xlabel: str = "concurrency") -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(xs)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)


def write_plots(results: Sequence[dict[str, Any]], img_dir: Path, subtitle: str = "") -> list[Path]:
    """Output throughput, TTFT and TPOT vs concurrency (random workload; hf static batches on the first);
    repeated runs are reduced to their median run."""
    results = median_runs(results)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    suffix = f"\n{subtitle}" if subtitle else ""

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs: set[int] = set()
    for engine, (x, y) in _series(results, ("random", "static-batch"), "output_throughput").items():
        static = all(r["workload"] == "static-batch" for r in results if r["engine"] == engine)
        ax.plot(x, y, marker="o", linestyle=":" if static else "-", label=engine)
        xs.update(x)
    if xs:
        xlabel = "concurrency (batch size for hf static batches, dotted)"
        _finish_axes(ax, xs, "Output throughput" + suffix, "output tokens/s", xlabel)
    written.append(_save(fig, img_dir / PLOT_FILES["throughput"]))

    for name, title in (("ttft", "Time to first token"), ("tpot", "Time per output token")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = set()
        p50 = _series(results, ("random",), f"median_{name}_ms")
        p99 = _series(results, ("random",), f"p99_{name}_ms")
        for i, (engine, (x, y)) in enumerate(p50.items()):
            color = f"C{i}"
            ax.plot(x, y, marker="o", color=color, label=f"{engine} p50")
            if engine in p99:
                ax.plot(*p99[engine], marker="^", linestyle="--", color=color, label=f"{engine} p99")
            xs.update(x)
        if xs:
            ax.set_yscale("log")  # engines differ by 10x and more
            _finish_axes(ax, xs, f"{title} (p50 solid, p99 dashed){suffix}", "ms (log scale)")
        written.append(_save(fig, img_dir / PLOT_FILES[name]))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
