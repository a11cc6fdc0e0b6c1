"""Where an embedding request's time goes, stage by stage, on the real code in one process.

    python benchmark/profile_embeddings.py                          # built-in model, 256 x 16 tokens
    python benchmark/profile_embeddings.py --inputs 64 --tokens 256

The built-in SmolLM2-135M served with --is-embedding (last-token pooling, normalised) embeds
--inputs texts of --tokens tokens each. The stages a server runs are timed one by one, each on the
code the server runs:

- tokenize: the TokenizerManager's tokenization and checks (prepare_embedding_items) of the texts;
- request IPC: pickling and unpickling the batch of tokenized requests (what ZMQ carries);
- admit: the scheduler turning them into requests (process_input_requests);
- batch formation: Scheduler.get_next_batch_to_run (policy, budgets, prepare_for_extend);
- forward: ModelRunner.forward_embedding without its pooling (the model on the prefill batch);
- pooling: embedding_outputs (pool, normalise, to the message's vectors);
- results: process_batch_result (finish, cache release, the BatchEmbeddingOut messages);
- result IPC: pickling and unpickling those messages;
- response: the /v1/embeddings JSON body from the outputs, float and base64.

Then the same texts through Engine.encode (the scheduler in its own process) for the end-to-end
time beside the sum. Timings are wall seconds on a shared machine: the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

WORDS = "the quick brown fox jumps over lazy dog capital of France is Paris one two three four five".split()


class Stages:
    """Wall time per stage, accumulated by wrapping the functions that make up each stage."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()

    def time(self, stage: str, fn: Callable[[], Any]) -> Any:  # noqa: ANN401
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds[stage] += time.perf_counter() - start

    def wrap(self, owner: Any, name: str, stage: str) -> None:  # noqa: ANN401 - a class or module
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            return self.time(stage, lambda: fn(*args, **kwargs))

        setattr(owner, name, timed)


def make_texts(tokenizer: Any, n: int, tokens: int) -> list[str]:  # noqa: ANN401
    """Texts of exactly `tokens` tokens: random words, cut by the tokenizer and decoded back."""
    rng = random.Random(0)
    texts = []
    while len(texts) < n:
        ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(tokens * 2)))[:tokens]
        text = tokenizer.decode(ids)
        if len(tokenizer.encode(text)) == tokens:
            texts.append(text)
    return texts


def profile_in_process(path: str, texts: list[str], stages: Stages) -> list[list[float]]:
    from radixserve.entrypoints.embedding_routes import embeddings_body
    from radixserve.managers.embedding_request import make_item, prepare_embedding_items
    from radixserve.managers.input_validation import ModelLimits
    from radixserve.managers.io_struct import BatchTokenizedEmbeddingReqInput, TokenizedEmbeddingReqInput
    from radixserve.model_executor import model_runner
    from radixserve.scheduler.scheduler import Scheduler
    from radixserve.testing.inprocess import InProcessScheduler

    stages.wrap(Scheduler, "get_next_batch_to_run", "batch formation")
    stages.wrap(model_runner.ModelRunner, "forward_embedding", "forward")
    stages.wrap(model_runner, "embedding_outputs", "pooling")
    stages.wrap(Scheduler, "process_batch_result", "results")
    sched = InProcessScheduler(
        path, is_embedding=True, max_total_tokens=65536, disable_overlap_schedule=True, log_level="warning"
    )
    try:
        mc = sched.model_config
        limits = ModelLimits(mc.vocab_size, mc.context_len, mc.context_len - 1)
        for i, text in enumerate(texts[:8]):  # warm-up (first-call costs), not timed
            sched.submit_embedding(f"warm{i}", sched.tokenizer.encode(text))
        sched.run_until_idle()
        warm_messages = len(sched.sent)
        stages.seconds.clear()
        items = [make_item(t) for t in texts]
        tokenized = stages.time("tokenize", lambda: prepare_embedding_items(sched.tokenizer, limits, items))
        msg = BatchTokenizedEmbeddingReqInput(
            [TokenizedEmbeddingReqInput(it.rid, it.text or "", ids) for it, (ids, _) in zip(items, tokenized)]
        )
        msg = stages.time("request IPC", lambda: pickle.loads(pickle.dumps(msg)))
        stages.time("admit", lambda: sched.scheduler.process_input_requests([msg]))
        start = time.perf_counter()
        results = sched.run_until_idle()
        stages.seconds["scheduler loop (all)"] += time.perf_counter() - start
        sent = sched.sent[warm_messages:]
        stages.time("result IPC", lambda: [pickle.loads(pickle.dumps(m)) for m in sent])
        outputs = [
            {"embedding": results[it.rid].embedding, "meta_info": {"prompt_tokens": len(ids)}}
            for it, (ids, _) in zip(items, tokenized)
        ]
        stages.time("response (float)", lambda: embeddings_body(outputs, "float", "default"))
        stages.time("response (base64)", lambda: embeddings_body(outputs, "base64", "default"))
        return [o["embedding"] for o in outputs]
    finally:
        sched.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--no-engine", action="store_true", help="skip the end-to-end Engine.encode run")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from radixserve.model_loader.default_model import ensure_default_model

    path = str(ensure_default_model(show_progress=False))
    texts = make_texts(AutoTokenizer.from_pretrained(path), args.inputs, args.tokens)
    load_start = os.getloadavg()[0]
    stages = Stages()
    profile_in_process(path, texts, stages)
    loop = stages.seconds.pop("scheduler loop (all)")
    forward = stages.seconds["forward"] - stages.seconds["pooling"]
    stages.seconds["forward"] = forward
    inside = sum(stages.seconds[k] for k in ("batch formation", "forward", "pooling", "results"))
    stages.seconds["scheduler loop, other"] = loop - inside
    total = sum(stages.seconds.values())
    print(
        f"built-in SmolLM2-135M --is-embedding, {args.inputs} inputs x {args.tokens} tokens, "
        f"load average {load_start:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print("| stage | seconds | share |\n|---|---:|---:|")
    for stage, sec in stages.seconds.items():
        print(f"| {stage} | {sec:.4f} | {100 * sec / total:.1f}% |")
    print(f"| sum | {total:.4f} | |")
    if not args.no_engine:
        from radixserve import Engine

        with Engine(model_path=path, is_embedding=True, log_level="warning") as engine:
            engine.encode(texts[:8])
            start = time.perf_counter()
            engine.encode(texts)
            e2e = time.perf_counter() - start
        print(
            f"Engine.encode end to end: {e2e:.3f} s ({args.inputs / e2e:.1f} inputs/s); "
            f"load average {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
