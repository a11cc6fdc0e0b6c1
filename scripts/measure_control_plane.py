"""Memory release / resume and weight-update costs on the built-in model (docs/benchmarks.md,
"Control plane"):

    PYTHONPATH=python .venv/bin/python scripts/measure_control_plane.py
"""

from __future__ import annotations

import glob
import time
from collections.abc import Callable
from typing import Any

import psutil

from radixserve import Engine
from radixserve.model_loader.default_model import ensure_default_model

PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 16, "temperature": 0}
POOL_TOKENS = 20000  # ~900 MiB of KV for SmolLM2-135M


def rss_mib(engine: Engine) -> int:
    return round(psutil.Process(engine.tokenizer_manager.ranks[0]["pid"]).memory_info().rss / 2**20)


def timed(what: str, engine: Engine, call: Callable[[], Any]) -> None:
    start = time.perf_counter()
    result = call()
    print(f"{what}: {time.perf_counter() - start:.2f} s, scheduler RSS {rss_mib(engine)} MiB, {result}")


def main() -> None:
    from safetensors.torch import load_file

    path = str(ensure_default_model(show_progress=False))
    with Engine(model_path=path, max_total_tokens=POOL_TOKENS, log_level="warning") as engine:
        reference = engine.generate(PROMPT, GREEDY)["output_ids"]
        print(f"after start: scheduler RSS {rss_mib(engine)} MiB")
        for tag in ("kv_cache", "weights"):
            timed(f"release {tag}", engine, lambda tag=tag: engine.release_memory_occupation([tag]))
        timed("resume both", engine, engine.resume_memory_occupation)
        print("same greedy after resume:", engine.generate(PROMPT, GREEDY)["output_ids"] == reference)
        timed("update_weights_from_disk", engine, lambda: engine.update_weights_from_disk(path)[0])
        tensors: dict[str, Any] = {}
        for file in glob.glob(f"{path}/*.safetensors"):
            tensors.update(load_file(file))
        timed(
            "update_weights_from_tensor (all)",
            engine,
            lambda: engine.update_weights_from_tensor(list(tensors.items()))[0],
        )
        print("same greedy after updates:", engine.generate(PROMPT, GREEDY)["output_ids"] == reference)


if __name__ == "__main__":
    main()
