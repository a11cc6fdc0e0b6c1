"""Memory release / resume and weight-update costs on the built-in model (docs/benchmarks.md,
"Control plane"):

    PYTHONPATH=python .venv/bin/python scripts/measure_control_plane.py
"""

from __future__ import annotations

import glob
import io
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


def sglang_bucket(tensors: dict[str, Any]) -> tuple[bytes, Any]:
    """SGLang's flattened bucket of every tensor, serialized as its MultiprocessingSerializer does
    (ForkingPickler: the bucket travels as a shared-memory handle, not as its bytes), and the
    bucket, which the sender keeps alive until the update is answered."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # noqa: F401 - torch's reductions for ForkingPickler

    from radixserve.model_executor.tensor_payload import FlattenedTensorMetadata

    flats, metadata, at = [], [], 0
    for name, t in tensors.items():
        flat = t.contiguous().flatten().view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, at, at + flat.numel(), flat.numel()))
        flats.append(flat)
        at += flat.numel()
    bucket = {"flattened_tensor": torch.cat(flats), "metadata": metadata}
    buf = io.BytesIO()
    ForkingPickler(buf).dump(bucket)
    return buf.getvalue(), bucket


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

        def update_from_bucket() -> bool:
            payload, _bucket = sglang_bucket(tensors)  # _bucket: alive until the answer
            return engine.update_weights_from_tensor([payload], load_format="flattened_bucket")[0]

        timed(
            "update_weights_from_tensor (all, SGLang flattened bucket over shared memory)",
            engine,
            update_from_bucket,
        )
        print("same greedy after updates:", engine.generate(PROMPT, GREEDY)["output_ids"] == reference)


if __name__ == "__main__":
    main()
