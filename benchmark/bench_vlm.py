"""Vision-language serving on this CPU: a Qwen2.5-VL-3B-shaped model with random weights, one
448x448 image (1024 patches, 256 image tokens) + 64 text tokens -> 64 out (docs/benchmarks.md,
"Vision-language").

The config is Qwen2.5-VL-3B-Instruct's (vision tower: 32 blocks of 1280, window 112, full
attention at 7/15/23/31; language model: 2048 hidden, 16/2 heads, 11008 intermediate, tied
embeddings, vocab 151936), with --num-hidden-layers of the language model's 36 layers (fewer
keep the run under ~12 GB of fp32 and within minutes; the count is printed). Weights are random
(--load-format dummy, so nothing is written but the config, the tiny test tokenizer with the
vision tokens and the image processor's config). Prompts are token ids: 32 random text ids, the
image, 32 more, so a new text prefix shares nothing with the radix cache before the image.

Reported: TTFT (first streamed chunk) cold (a new image), with the image's embedding cached (the
same image after a new text prefix: no radix reuse, the encoder skipped), and the same prompt
again (radix prefix through the image), each the median of --repeats after one warm-up request;
the encoder's ms per image as cold minus embedding-cached TTFT (the only difference between the
two); output tok/s at C=1 and C=8 (distinct new images, 64 tokens each, ignore_eos): end to end
(encoding and prefill included) and the decode's alone.

    python benchmark/bench_vlm.py --num-hidden-layers 12 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

TEXT = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    "bos_token_id": 1,
    "eos_token_id": 2,
}
VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 2048,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "hidden_act": "silu",
}
NUM_TEXT = 64
NUM_OUT = 64


def write_model(path: Path, num_layers: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from radixserve.testing.tiny_vlm import qwen2_5_vl_config, write_vlm_tokenizer

    qwen2_5_vl_config(
        {**TEXT, "num_hidden_layers": num_layers}, VISION, tie_word_embeddings=True
    ).save_pretrained(path)
    write_vlm_tokenizer(path)
    # Qwen2.5-VL's own pixel limits: a 448x448 image stays 448x448 (32x32 patches).
    Qwen2VLImageProcessorPil(
        min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2
    ).save_pretrained(str(path))


def image(seed: int) -> str:
    from radixserve.testing.tiny_vlm import image_data_url, random_image

    return image_data_url(random_image(448, 448, seed=seed))


def prompt_ids(rng: random.Random) -> list[int]:
    from radixserve.testing.tiny_vlm import IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID

    def text(n: int) -> list[int]:
        return [rng.randrange(10, 384) for _ in range(n)]

    return [*text(NUM_TEXT // 2), VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID, *text(NUM_TEXT // 2)]


def ttft(engine: Any, ids: list[int], img: str) -> float:  # noqa: ANN401 - an Engine
    params = {"max_new_tokens": 1, "temperature": 0.0}
    start = time.perf_counter()
    for _ in engine.generate(input_ids=ids, sampling_params=params, image_data=img, stream=True):
        return time.perf_counter() - start
    raise RuntimeError("no output")


def throughput(engine: Any, rng: random.Random, concurrency: int, seed: int) -> tuple[float, float]:  # noqa: ANN401
    """(end-to-end output tok/s with new images, decode tok/s): the prompts are first sent for one
    token (encoding the images, caching the prompts), then for NUM_OUT, whose prefill is then a
    radix hit, so the second wall is the decode's."""
    ids = [prompt_ids(rng) for _ in range(concurrency)]
    images = [image(seed + i) for i in range(concurrency)]
    walls = []
    for num in (1, NUM_OUT):
        params = {"max_new_tokens": num, "temperature": 0.0, "ignore_eos": True}
        start = time.perf_counter()
        outs = engine.generate(input_ids=ids, sampling_params=params, image_data=images)
        walls.append(time.perf_counter() - start)
        assert sum(len(o["output_ids"]) for o in outs) == concurrency * num
    tokens = concurrency * NUM_OUT
    return tokens / sum(walls), tokens / walls[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-hidden-layers", type=int, default=12, help="language-model layers (of 36)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from radixserve import Engine

    rng = random.Random(0)
    result: dict[str, Any] = {"num_hidden_layers": args.num_hidden_layers, "vision_depth": VISION["depth"]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_model(path, args.num_hidden_layers)
        engine_args = {"load_format": "dummy", "context_length": 4096, "max_total_tokens": 16384}
        with Engine(model_path=str(path), log_level="warning", **engine_args) as engine:
            ttft(engine, prompt_ids(rng), image(500))  # warm-up: first-call costs off the clock
            cold, cached, radix = [], [], []
            for r in range(args.repeats):
                img, first = image(600 + r), prompt_ids(rng)
                cold.append(ttft(engine, first, img))
                cached.append(ttft(engine, prompt_ids(rng), img))  # new text prefix, same image
                radix.append(ttft(engine, first, img))  # the same prompt again
            result["ttft_cold_s"] = round(statistics.median(cold), 3)
            result["ttft_embedding_cached_s"] = round(statistics.median(cached), 3)
            result["ttft_same_prompt_s"] = round(statistics.median(radix), 3)
            result["cached_over_cold"] = round(result["ttft_embedding_cached_s"] / result["ttft_cold_s"], 3)
            # The two TTFTs differ only by the encoder (same lengths, no radix reuse in either).
            result["encoder_ms_per_image"] = round(
                1000 * (statistics.median(cold) - statistics.median(cached))
            )
            print(json.dumps(result), flush=True)
            for c in (1, 8):
                e2e, decode = throughput(engine, rng, c, 700 + 100 * c)
                result[f"output_tok_s_c{c}"] = round(e2e, 2)
                result[f"decode_tok_s_c{c}"] = round(decode, 2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
