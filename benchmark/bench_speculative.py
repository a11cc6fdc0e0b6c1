"""Speculative decoding side by side: the same prompts through an Engine without speculation and
one with NGRAM (one or more --speculative-num-draft-tokens), at concurrency 1 and 4, on a copy-heavy
workload (rewrite / summarise a given passage, edit a code file), on open-ended questions ("novel")
and on random token prompts.

    python benchmark/bench_speculative.py                    # built-in model, draft tokens 8
    python benchmark/bench_speculative.py --draft-tokens 4 8 12 --max-new-tokens 160
    git worktree add /tmp/base HEAD~1 && python benchmark/bench_speculative.py --baseline-tree /tmp/base

--baseline-tree runs each NGRAM mode a second time ("base-K") with the engine's processes importing
radixserve from another checkout: two versions of the speculation code side by side in one run
(sgl-kernel is the installed one for both).

Prints one row per (workload, concurrency, mode): output tokens, wall seconds, tok/s, the speedup
over the plain run, and the mean spec_accept_length (tokens per verify forward); then each
workload's answer lengths. Greedy decoding, so every mode produces the same tokens (the script
checks it).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

PASSAGE_1 = (
    "The lighthouse stood at the edge of the northern cliffs for more than two centuries. Its keepers "
    "lived in a small stone cottage beside the tower, and every evening one of them climbed the one "
    "hundred and twelve steps to light the great lamp. In winter the storms were so strong that the "
    "windows of the cottage had to be shuttered for weeks at a time, and supplies arrived only when "
    "the sea was calm enough for the small boat from the village to cross the bay. The last keeper, "
    "a quiet woman named Elsa Brandt, kept a diary in which she recorded the weather, the ships that "
    "passed, and the birds that rested on the gallery rail. When the lamp was automated in 1987, she "
    "moved to the village, but she still walked to the cliffs every Sunday to watch the light come on."
)
PASSAGE_2 = (
    "Our team recieved the quarterly report on Monday. The main finding is that customer retention "
    "improved by six percent, mostly because the new onboarding emails explained the product more "
    "clearly. However, the support queue grew longer in the second month, and the average response "
    "time rose from four hours to nine hours. The report recomends hiring two additional support "
    "engineers, moving the documentation to a searchable site, and adding a short video to the "
    "onboarding sequence. The budget for these changes is estimated at forty thousand dollars for the "
    "next quarter, which the finance team has already aproved in principle."
)
CODE = '''def compute_total(items, tax_rate):
    """Return the total price of the items including tax."""
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def format_receipt(items, tax_rate):
    lines = []
    for item in items:
        lines.append(f"{item['name']}: {item['price'] * item['quantity']:.2f}")
    total = compute_total(items, tax_rate)
    lines.append(f"Total: {total:.2f}")
    return "\\n".join(lines)
'''

COPY_TASKS = [
    f"Rewrite the following passage in the past tense, keeping every detail:\n\n{PASSAGE_1}",
    f"Fix the spelling mistakes in the following text and output the corrected text:\n\n{PASSAGE_2}",
    f"Rename the function compute_total to sum_prices in this code and output the whole file:\n\n{CODE}",
    f"Summarise the following passage, quoting its key sentences:\n\n{PASSAGE_1}",
]


NOVEL_TASKS = [
    "Write a short story about a dragon who is afraid of the dark.",
    "Explain how a bicycle gear system works to a ten-year-old.",
    "Give me five ideas for a weekend trip in the mountains, with one sentence each.",
    "What are the pros and cons of working from home?",
]


def chat_prompts(tokenizer: Any, tasks: list[str]) -> list[list[int]]:  # noqa: ANN401 - an HF tokenizer
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
        )
        for t in tasks
    ]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def copy_prompts(tokenizer: Any) -> list[list[int]]:  # noqa: ANN401 - an HF tokenizer
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
        )
        for t in COPY_TASKS
    ]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def random_prompts(vocab_size: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(n)]


def run_cell(engine: Any, prompts: list[list[int]], concurrency: int, params: dict) -> dict[str, Any]:  # noqa: ANN401
    outputs: list[dict] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        group = prompts[i : i + concurrency]
        outputs += engine.generate(input_ids=group, sampling_params=[dict(params) for _ in group])
    wall = time.perf_counter() - start
    lengths = [o["meta_info"]["completion_tokens"] for o in outputs]
    tokens = sum(lengths)
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outputs)
    verify_tokens = sum(
        o["meta_info"].get("spec_accept_length", 0.0) * o["meta_info"].get("spec_verify_ct", 0)
        for o in outputs
    )
    return {
        "tokens": tokens,
        "lengths": lengths,
        "wall": wall,
        "tok_s": tokens / wall,
        "accept_length": verify_tokens / verify if verify else None,
        "output_ids": [o["output_ids"] for o in outputs],
    }


def start_engine(engine_cls: type, tree: str | None, **kwargs: Any) -> Any:  # noqa: ANN401 - an Engine
    """An Engine whose processes import radixserve from `tree`/python when given: they are spawned,
    and a spawned process starts from this process's sys.path."""
    saved = list(sys.path)
    if tree is not None:
        sys.path.insert(0, os.path.join(os.path.abspath(tree), "python"))
    try:
        return engine_cls(**kwargs)
    finally:
        sys.path[:] = saved


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the built-in model")
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[8])
    parser.add_argument(
        "--draft-layers",
        type=int,
        nargs="*",
        default=[],
        help="also run STANDALONE self-speculation with the target's first N layers as the draft",
    )
    parser.add_argument("--standalone-draft-tokens", type=int, default=4)
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="copy and novel answers end by themselves below it (the built-in model's copy answers "
        "are 115-167 tokens), so a rewrite is measured whole; random prompts run to it (ignore_eos)",
    )
    parser.add_argument("--random-prompt-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=8192,
        help="KV pool per engine (several engines are up at once)",
    )
    parser.add_argument(
        "--cpu-threads", type=int, default=None, help="torch threads per engine (default: all)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="passes per cell; the median is reported")
    parser.add_argument(
        "--workloads", nargs="+", default=["copy", "novel", "random"], choices=["copy", "novel", "random"]
    )
    parser.add_argument(
        "--baseline-tree",
        default=None,
        help="a checkout (e.g. a git worktree of an earlier commit) whose radixserve the base-K modes run",
    )
    parser.add_argument(
        "--compare-batch-backoff",
        action="store_true",
        help="also run each NGRAM mode with --disable-speculative-batch-backoff (the per-request rule only)",
    )
    args = parser.parse_args()

    from radixserve import Engine
    from radixserve.managers.tokenizer_manager import load_tokenizer

    modes: list[tuple[str, dict[str, Any]]] = [("plain", {})]
    modes += [
        (f"ngram-{k}", {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": k})
        for k in args.draft_tokens
    ]
    if args.compare_batch_backoff:
        modes += [
            (
                f"ngram-{k}-req",
                {
                    "speculative_algorithm": "NGRAM",
                    "speculative_num_draft_tokens": k,
                    "disable_speculative_batch_backoff": True,
                },
            )
            for k in args.draft_tokens
        ]
    if args.baseline_tree:
        modes += [
            (f"base-{k}", {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": k})
            for k in args.draft_tokens
        ]
    modes += [
        (
            f"self-L{n}",
            {
                "speculative_algorithm": "STANDALONE",
                "speculative_draft_layers": n,
                "speculative_num_draft_tokens": args.standalone_draft_tokens,
            },
        )
        for n in args.draft_layers
    ]
    # Every engine is up at once and the cells run round-robin (each mode in turn for each workload
    # and concurrency, --repeats passes, median wall time): on a shared, noisy machine the modes
    # then see the same load.
    engines = {
        mode: start_engine(
            Engine,
            args.baseline_tree if mode.startswith("base-") else None,
            model_path=args.model_path,
            log_level="warning",
            max_total_tokens=args.max_total_tokens,
            cpu_threads=args.cpu_threads,
            **extra,
        )
        for mode, extra in modes
    }
    results: dict[tuple[str, int, str], dict[str, Any]] = {}
    try:
        tok = load_tokenizer(engines["plain"].server_args)
        n = max(args.concurrency)
        copy = copy_prompts(tok)
        workloads: dict[str, tuple[list[list[int]], dict]] = {
            "copy": (
                (copy * n)[: max(n, len(copy))],
                {"temperature": 0.0, "max_new_tokens": args.max_new_tokens},
            ),
            # Open-ended questions: the answer is new text, little of it is in the prompt.
            "novel": (
                (chat_prompts(tok, NOVEL_TASKS) * n)[: max(n, len(NOVEL_TASKS))],
                {"temperature": 0.0, "max_new_tokens": args.max_new_tokens},
            ),
            "random": (
                random_prompts(len(tok), max(n, 4), args.random_prompt_len),
                {"temperature": 0.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True},
            ),
        }
        for engine in engines.values():  # warm up
            engine.generate(input_ids=[copy[0]], sampling_params={"max_new_tokens": 8})
        workloads = {name: w for name, w in workloads.items() if name in args.workloads}
        for name, (prompts, params) in workloads.items():
            for c in args.concurrency:
                runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode, _ in modes}
                for _ in range(args.repeats):
                    for mode, _ in modes:
                        runs[mode].append(run_cell(engines[mode], prompts, c, params))
                for mode, cells in runs.items():
                    cells.sort(key=lambda r: r["wall"])
                    results[(name, c, mode)] = cells[len(cells) // 2]
                print(f"done: {name} concurrency {c}", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()

    print(
        f"{'workload':8} {'conc':>4} {'mode':10} {'tokens':>6} {'wall s':>7} {'tok/s':>7} {'speedup':>7} {'accept_len':>10}"
    )
    for name in workloads:
        for c in args.concurrency:
            base = results[(name, c, "plain")]
            for mode, _ in modes:
                r = results[(name, c, mode)]
                same = "" if r["output_ids"] == base["output_ids"] else "  OUTPUT DIFFERS"
                acc = f"{r['accept_length']:.2f}" if r["accept_length"] is not None else "-"
                print(
                    f"{name:8} {c:>4} {mode:10} {r['tokens']:>6} {r['wall']:>7.1f} {r['tok_s']:>7.1f} "
                    f"{r['tok_s'] / base['tok_s']:>6.2f}x {acc:>10}{same}"
                )
    # Whether answers ended by themselves or at --max-new-tokens (every mode's are the same).
    for name in workloads:
        lengths = results[(name, min(args.concurrency), "plain")]["lengths"]
        print(f"{name} answer lengths (tokens, cap {args.max_new_tokens}): {' '.join(map(str, lengths))}")


if __name__ == "__main__":
    main()
