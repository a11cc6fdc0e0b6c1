"""Benchmark prompts: random token ids, generated shared-prefix groups, and ShareGPT conversations.

Synthetic datasets are built as token ids, so their lengths are exact and no tokenizer is needed.
When the backend only takes text (chat), ids are decoded with the tokenizer and the prompt length
is re-counted, because decode/encode is not a bijection.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class DatasetRow:
    prompt: Prompt
    prompt_len: int
    output_len: int


def lengths_in_range(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """`n` lengths drawn uniformly from [length * range_ratio, length] (at least 1).

    range_ratio 1.0 means every request has exactly `length`; 0.0 means anything from 1 up.
    """
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(length * range_ratio))
    high = max(low, length)
    return [rng.randint(low, high) for _ in range(n)]


def vocab_choices(vocab_size: int, special_ids: list[int] | None = None) -> list[int]:
    """Token ids a random prompt may use: the vocabulary minus special tokens (no stray EOS/BOS)."""
    special = set(special_ids or [])
    ids = [i for i in range(vocab_size) if i not in special]
    if not ids:
        raise ValueError(f"No usable token ids in a vocabulary of {vocab_size}")
    return ids


def random_ids(rng: random.Random, n: int, choices: list[int]) -> list[int]:
    return [rng.choice(choices) for _ in range(n)]


def _finish(ids: list[int], output_len: int, tokenizer: Any | None, as_text: bool) -> DatasetRow:
    if not as_text:
        return DatasetRow(prompt=ids, prompt_len=len(ids), output_len=output_len)
    text = tokenizer.decode(ids)
    return DatasetRow(
        prompt=text, prompt_len=len(tokenizer.encode(text, add_special_tokens=False)), output_len=output_len
    )


def _require_tokenizer(tokenizer: Any | None, as_text: bool, what: str) -> None:
    if as_text and tokenizer is None:
        raise ValueError(
            f"{what} needs a tokenizer (--tokenizer PATH) to build text prompts for this backend"
        )


def gen_random_ids(
    rng: random.Random,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    choices: list[int],
    tokenizer: Any | None = None,
    as_text: bool = False,
) -> list[DatasetRow]:
    """Independent random-token prompts; input and output lengths both honour `range_ratio`."""
    _require_tokenizer(tokenizer, as_text, "random-ids")
    in_lens = lengths_in_range(rng, num_prompts, input_len, range_ratio)
    out_lens = lengths_in_range(rng, num_prompts, output_len, range_ratio)
    return [_finish(random_ids(rng, i, choices), o, tokenizer, as_text) for i, o in zip(in_lens, out_lens)]


def gen_shared_prefix(
    rng: random.Random,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    choices: list[int],
    tokenizer: Any | None = None,
    as_text: bool = False,
) -> list[DatasetRow]:
    """`num_groups` system prompts, each followed by `prompts_per_group` distinct questions.

    Rows are shuffled so groups interleave: a prefix cache then has to keep several prefixes
    alive at once, which is the case worth measuring.
    """
    _require_tokenizer(tokenizer, as_text, "generated-shared-prefix")
    rows: list[DatasetRow] = []
    for _ in range(num_groups):
        prefix = random_ids(rng, system_prompt_len, choices)
        # Decode the prefix on its own so every row of the group starts with the same string.
        prefix_text = tokenizer.decode(prefix) if as_text else ""
        for _ in range(prompts_per_group):
            question = random_ids(rng, question_len, choices)
            if as_text:
                # A newline keeps the boundary tokens from merging; prompt_len is re-counted anyway.
                text = prefix_text + "\n" + tokenizer.decode(question)
                n = len(tokenizer.encode(text, add_special_tokens=False))
                rows.append(DatasetRow(prompt=text, prompt_len=n, output_len=output_len))
            else:
                rows.append(
                    DatasetRow(
                        prompt=prefix + question,
                        prompt_len=len(prefix) + len(question),
                        output_len=output_len,
                    )
                )
    rng.shuffle(rows)
    return rows


def synthetic_dataset(
    args: argparse.Namespace,
    rng: random.Random,
    choices: list[int],
    tokenizer: Any | None = None,
    as_text: bool = False,
) -> list[DatasetRow]:
    """The rows of --dataset-name random-ids (the --random-* flags) or generated-shared-prefix
    (the --gsp-* flags), as the benchmarks' command lines name them."""
    if args.dataset_name == "random-ids":
        return gen_random_ids(
            rng,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            choices,
            tokenizer,
            as_text,
        )
    return gen_shared_prefix(
        rng,
        args.gsp_num_groups,
        args.gsp_prompts_per_group,
        args.gsp_system_prompt_len,
        args.gsp_question_len,
        args.gsp_output_len,
        choices,
        tokenizer,
        as_text,
    )


def _first_turns(entry: dict[str, Any]) -> tuple[str, str] | None:
    """(first human turn, the reply to it) of one ShareGPT entry, or None when it has no reply."""
    turns = entry.get("conversations") or entry.get("conversation") or []
    if len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    prompt = first.get("value", first.get("content"))
    reply = second.get("value", second.get("content"))
    if not isinstance(prompt, str) or not isinstance(reply, str):
        return None
    return prompt, reply


def load_sharegpt(
    path: str,
    num_prompts: int,
    tokenizer: Any,
    rng: random.Random,
    fixed_output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[DatasetRow]:
    """First exchange of ShareGPT conversations, shuffled, with token counts from `tokenizer`.

    The reply's length becomes the output budget unless `fixed_output_len` is given. Very short
    pairs (< 4 tokens) and ones over the length limits are skipped, as real chat traffic is.
    """
    if tokenizer is None:
        raise ValueError("sharegpt needs a tokenizer (--tokenizer PATH) to count prompt tokens")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [p for p in (_first_turns(e) for e in data) if p is not None]
    rng.shuffle(pairs)
    rows: list[DatasetRow] = []
    for prompt, reply in pairs:
        if len(rows) >= num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = fixed_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < 4 or output_len < 4:
            continue
        if fixed_output_len is None and (
            prompt_len > max_prompt_len or prompt_len + output_len > max_total_len
        ):
            continue
        rows.append(DatasetRow(prompt=prompt, prompt_len=prompt_len, output_len=output_len))
    if not rows:
        raise ValueError(f"{path} has no usable conversations")
    if len(rows) < num_prompts:
        logger.warning("%s has only %d usable conversations; asked for %d", path, len(rows), num_prompts)
    return rows
