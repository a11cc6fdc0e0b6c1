"""ServerArgs' speculative-decoding flags, defaults and checks (docs/speculative_decoding.md),
kept apart from server_args.py so that file stays readable. `args` is the ServerArgs being resolved."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from radixserve.configs.arg_field import arg_field

if TYPE_CHECKING:
    from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
NGRAM_MATCH_TYPES = ("BFS", "PROB")

# ServerArgs' speculative fields (server_args.py declares each under the same name).
speculative_algorithm = arg_field(
    None,
    "Speculative decoding: NGRAM drafts from n-grams of each request's own prompt and output (no "
    "draft model); STANDALONE drafts with a separate draft model (--speculative-draft-model-path) "
    "or with the target's first --speculative-draft-layers layers (self-speculation); EAGLE / "
    "EAGLE3 draft with an EAGLE head (--speculative-draft-model-path) reading the target's hidden states.",
    choices=SPECULATIVE_ALGORITHMS,
)
speculative_draft_model_path = arg_field(
    None,
    "STANDALONE: the draft model's folder (a smaller model with the target's tokenizer; its own KV "
    "pool with the target's slots); EAGLE / EAGLE3: the head's folder (HF format, "
    "LlamaForCausalLMEagle / LlamaForCausalLMEagle3).",
)
speculative_draft_layers = arg_field(
    None,
    "STANDALONE without a draft model path: the draft is the target's own first N layers with "
    "its final norm and LM head (self-speculation; shares the target's KV pool).",
)
speculative_num_steps = arg_field(
    None,
    "Draft steps per round (draft-model algorithms): the depth of the draft tree. Default: "
    "num_draft_tokens - 1 for a chain; 3 for a tree (--speculative-eagle-topk > 1); EAGLE on CPU: 3.",
)
speculative_eagle_topk = arg_field(
    None,
    "STANDALONE / EAGLE: branching of the draft tree; each draft step keeps the topk most likely "
    "continuations (by the draft's cumulative probability). 1 (the default) drafts a chain.",
)
speculative_num_draft_tokens = arg_field(
    None,
    "Tokens per request in one verify forward: the last accepted token plus up to this many "
    "minus one drafted ones. Default: --speculative-num-steps + 1 when set; else NGRAM: 8 on CPU, "
    "--speculative-ngram-max-match-window-size on CUDA; STANDALONE / EAGLE: 4 (a chain), 1 + topk x "
    "num_steps (a tree); EAGLE off CPU with triton or torch-native attention: SGLang's 5 steps, topk 4, 8 tokens.",
)
speculative_ngram_min_match_window_size = arg_field(
    1, "NGRAM: shortest suffix of the context that must match an earlier n-gram to draft."
)
speculative_ngram_max_match_window_size = arg_field(
    12, "NGRAM: longest suffix of the context tried first when matching."
)
speculative_ngram_min_bfs_breadth = arg_field(
    1, "NGRAM: narrowest breadth of the BFS draft tree (a long match, deep in the tree)."
)
speculative_ngram_max_bfs_breadth = arg_field(
    None,
    "NGRAM: widest breadth of the BFS draft tree (a short match, at its first level); 1 drafts a "
    "chain. Default: 1 on CPU (a CPU verify step costs per token), 10 (SGLang's) elsewhere.",
)
speculative_ngram_match_type = arg_field(
    "BFS",
    "NGRAM: how the draft tree is built. BFS: SGLang's breadth-first tree (see "
    "--speculative-ngram-max-bfs-breadth). PROB is accepted and builds the same BFS tree. A chain "
    "follows the most frequent continuation (ties: the most recent).",
    choices=NGRAM_MATCH_TYPES,
)
speculative_ngram_branch_length = arg_field(
    18, "NGRAM: longest n-gram stored in a request's trie (its depth)."
)
disable_speculative_batch_backoff = arg_field(
    False,
    "radixserve's own: turn off the batch-level back-off rule (each request drafts as many tokens "
    "as its acceptance pays for at the measured cost of a verify row, and a step drafts only when "
    "its expected accepted drafts pay for the verify step's measured extra cost at this batch "
    "size; docs/speculative_decoding.md). The per-request back-off stays.",
)
speculative_ngram_capacity = arg_field(
    10 * 1000 * 1000,
    "NGRAM: most trie nodes per request; past it new n-grams are no longer stored.",
)


def speculative_updates(args: ServerArgs, device: str) -> dict[str, Any]:
    """Speculation's defaults. The verify forward runs in the normal loop only (SGLang also turns
    the overlap loop off for NGRAM), and a verify batch cannot carry a prefill chunk."""
    if args.enable_overlap_schedule:
        raise ValueError(
            "--speculative-algorithm does not run with the overlap loop: the next step's drafts "
            "depend on how many tokens this step accepted, which the overlap loop does not know "
            "when it builds the next batch. Drop --enable-overlap-schedule."
        )
    updates: dict[str, Any] = {"disable_overlap_schedule": True, "enable_mixed_chunk": False}
    if args.speculative_algorithm in ("EAGLE", "EAGLE3"):
        updates.update(_eagle_defaults(args, device))
    if args.speculative_eagle_topk is None and "speculative_eagle_topk" not in updates:
        updates["speculative_eagle_topk"] = 1
    if args.speculative_ngram_max_bfs_breadth is None:
        updates["speculative_ngram_max_bfs_breadth"] = 1 if device == "cpu" else 10
    topk = updates.get("speculative_eagle_topk", args.speculative_eagle_topk)
    if topk > 1:  # a draft tree: num_steps levels of up to topk rows each
        steps = updates.get("speculative_num_steps", args.speculative_num_steps)
        num = updates.get("speculative_num_draft_tokens", args.speculative_num_draft_tokens)
        if steps is None:
            steps = 3 if num is None else -(-(num - 1) // topk)
        updates["speculative_num_steps"] = steps
        updates["speculative_num_draft_tokens"] = num if num is not None else 1 + topk * steps
        return updates
    if args.speculative_num_draft_tokens is None and "speculative_num_draft_tokens" not in updates:
        # A CPU verify forward costs more per extra token than a GPU one, so fewer drafts than
        # SGLang's 12 (not tuned by a sweep: docs/speculative_decoding.md).
        if args.speculative_num_steps is not None:
            updates["speculative_num_draft_tokens"] = args.speculative_num_steps + 1
        elif args.speculative_algorithm in ("STANDALONE", "EAGLE", "EAGLE3"):
            updates["speculative_num_draft_tokens"] = 4  # SGLang's choice for STANDALONE: 3 steps
        elif device == "cpu":
            updates["speculative_num_draft_tokens"] = 8
        else:
            updates["speculative_num_draft_tokens"] = args.speculative_ngram_max_match_window_size
    num_draft = updates.get("speculative_num_draft_tokens", args.speculative_num_draft_tokens)
    updates["speculative_num_steps"] = num_draft - 1
    return updates


def log_speculative(args: ServerArgs) -> None:
    logger.info(
        "Speculative decoding: algorithm=%s num_draft_tokens=%d num_steps=%d eagle_topk=%d "
        "ngram_bfs_breadth=%d..%d ngram_match_window=%d..%d ngram_branch_length=%d (overlap loop "
        "and mixed chunk off)",
        args.speculative_algorithm,
        args.speculative_num_draft_tokens,
        args.speculative_num_steps,
        args.speculative_eagle_topk,
        args.speculative_ngram_min_bfs_breadth,
        args.speculative_ngram_max_bfs_breadth,
        args.speculative_ngram_min_match_window_size,
        args.speculative_ngram_max_match_window_size,
        args.speculative_ngram_branch_length,
    )


def _eagle_defaults(args: ServerArgs, device: str) -> dict[str, Any]:
    """EAGLE / EAGLE3 with none of num-steps / topk / num-draft-tokens given: SGLang's choice for
    Llama targets (5 steps, topk 4, 8 draft tokens) off CPU with the backends that have a tree mask
    (triton, the CUDA default, and torch-native; a chain of 5 with FlashInfer); on CPU a chain of 3 steps (4 verify rows), as
    for STANDALONE: every verify row costs on CPU. With topk 1 the draft tokens follow
    the steps (num-steps + 1), as SGLang adjusts them."""
    given = (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens)
    if all(v is None for v in given):
        if device == "cpu":
            steps, topk, num = 3, 1, 4
        elif (args.attention_backend or "triton") in ("triton", "torch_native"):  # None: CUDA's triton
            steps, topk, num = 5, 4, 8
        else:  # no tree mask in the FlashInfer backend yet: SGLang's depth as a chain
            steps, topk, num = 5, 1, 6
        return {
            "speculative_num_steps": steps,
            "speculative_eagle_topk": topk,
            "speculative_num_draft_tokens": num,
        }
    if args.speculative_eagle_topk in (None, 1) and args.speculative_num_steps is not None:
        return {"speculative_eagle_topk": 1, "speculative_num_draft_tokens": args.speculative_num_steps + 1}
    return {}


def validate_speculative(args: ServerArgs) -> None:
    algo = args.speculative_algorithm  # one of its declared choices, checked with every flag's
    if algo is None:
        return
    _check_draft_source(args, algo)
    _check_tree_shape(args, algo)
    _check_ngram(args)
    if args.pp_size > 1:
        raise ValueError("--speculative-algorithm is not supported with --pp-size > 1")
    if args.disaggregation_mode != "null":
        raise ValueError("--speculative-algorithm is not supported with --disaggregation-mode yet")
    if args.is_embedding:
        raise ValueError("--speculative-algorithm applies to generation; drop it with --is-embedding")


def _check_draft_source(args: ServerArgs, algo: str) -> None:
    """Where the drafts come from: a head, a draft model, the target's first layers, n-grams."""
    if algo in ("EAGLE", "EAGLE3"):
        if not args.speculative_draft_model_path:
            raise ValueError(
                f"--speculative-algorithm {algo} needs --speculative-draft-model-path: a folder with an "
                f"{algo} head in the HF format (config.json + safetensors)"
            )
        if args.speculative_draft_layers:
            raise ValueError(f"--speculative-draft-layers applies to STANDALONE, not {algo}")
        if args.tp_size > 1:
            raise ValueError(
                f"--speculative-algorithm {algo} runs with --tp-size 1 for now (the head is not sharded)"
            )
    if algo == "STANDALONE":
        if bool(args.speculative_draft_model_path) == bool(args.speculative_draft_layers):
            raise ValueError(
                "--speculative-algorithm STANDALONE takes a draft: either --speculative-draft-model-path "
                "(a separate model with the target's tokenizer) or --speculative-draft-layers N (the "
                "target's first N layers), not both"
            )
        if args.speculative_draft_model_path and args.tp_size > 1:
            raise ValueError(
                "--speculative-draft-model-path runs with --tp-size 1 for now (the draft model is not sharded)"
            )
    if algo == "NGRAM" and args.speculative_draft_layers:
        raise ValueError("--speculative-draft-layers applies to STANDALONE, not NGRAM")


def _check_tree_shape(args: ServerArgs, algo: str) -> None:
    """Chains or trees, and how many draft tokens a verify step holds."""
    topk = args.speculative_eagle_topk
    if topk is not None and topk < 1:
        raise ValueError(f"--speculative-eagle-topk must be >= 1, got {topk}")
    if algo == "NGRAM" and topk not in (None, 1):
        raise ValueError(
            "--speculative-eagle-topk applies to draft models; NGRAM's trees are shaped by "
            "--speculative-ngram-max-bfs-breadth"
        )
    lo_b, hi_b = args.speculative_ngram_min_bfs_breadth, args.speculative_ngram_max_bfs_breadth
    if not 1 <= lo_b <= (hi_b if hi_b is not None else lo_b):
        raise ValueError(
            "--speculative-ngram-min-bfs-breadth must be >= 1 and <= --speculative-ngram-max-bfs-breadth "
            f"(got {lo_b} and {hi_b})"
        )
    trees = (topk or 1) > 1 or (algo == "NGRAM" and (hi_b or 1) > 1)
    if trees and args.attention_backend not in (None, "cpu", "torch_native", "triton"):
        raise ValueError(
            "Draft trees (--speculative-eagle-topk > 1, --speculative-ngram-max-bfs-breadth > 1) need "
            "a tree mask, which only the cpu, torch_native and triton attention backends implement; "
            f"use chains (1) with --attention-backend {args.attention_backend}"
        )
    if (
        (topk or 1) > 1
        and args.speculative_num_steps is not None
        and args.speculative_num_draft_tokens is not None
    ):
        if args.speculative_num_draft_tokens - 1 > topk * args.speculative_num_steps:
            raise ValueError(
                "--speculative-num-draft-tokens - 1 must be <= --speculative-eagle-topk x "
                "--speculative-num-steps (the draft tree keeps at most topk rows per step)"
            )
    if args.speculative_num_draft_tokens is not None and args.speculative_num_draft_tokens < 2:
        raise ValueError("--speculative-num-draft-tokens must be >= 2 (the last token plus one draft)")


def _check_ngram(args: ServerArgs) -> None:
    lo, hi = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
    if not 1 <= lo <= hi:
        raise ValueError(
            "--speculative-ngram-min-match-window-size must be >= 1 and <= "
            f"--speculative-ngram-max-match-window-size (got {lo} and {hi})"
        )
    if args.speculative_ngram_branch_length <= hi:
        raise ValueError(
            "--speculative-ngram-branch-length must exceed --speculative-ngram-max-match-window-size "
            "(a match needs at least one stored token after it)"
        )
    if args.speculative_ngram_capacity < 1:
        raise ValueError("--speculative-ngram-capacity must be >= 1")
