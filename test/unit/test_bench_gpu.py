"""benchmark/bench_gpu.py on a CPU: the model folders it makes load, its HBM-bound arithmetic, and
its attention harness runs end to end (tiny shapes), so the GPU session finds it working."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import bench_gpu  # noqa: E402

from radixserve.configs.model_config import ModelConfig  # noqa: E402

LLAMA3_8B_PARAMS = 8_030_261_248  # Meta's published count, embedding included
LLAMA3_8B_EMBEDDING = 128_256 * 4_096


def test_decode_bytes_reads_every_weight_once_plus_the_kv():
    cfg = bench_gpu.LLAMA3_8B
    weights = bench_gpu.decode_bytes(cfg, batch_size=1, context_len=0, bytes_per_value=1)
    # All weights but the embedding table, of which a decode step reads one row per request.
    assert weights == LLAMA3_8B_PARAMS - LLAMA3_8B_EMBEDDING + 4096
    kv = bench_gpu.decode_bytes(cfg, 64, 1000, 2) - bench_gpu.decode_bytes(cfg, 64, 0, 2)
    assert kv == 64 * 1000 * 32 * 8 * 128 * 2 * 2  # tokens x layers x kv heads x dim x (k, v) x bf16


def test_ceiling_rows_compare_steps_with_the_bound():
    result = {"engine": "radixserve", "batch_size": 1, "input_len": 1024, "output_len": 32}
    result.update(median_decode_latency=0.0060, median_decode_throughput=166.7)
    rows = bench_gpu.ceiling_rows(bench_gpu.LLAMA3_8B, [result, {**result, "engine": "hf"}], 3.35)
    assert len(rows) == 3  # header, separator, the radixserve row only
    bound_ms = bench_gpu.decode_bytes(bench_gpu.LLAMA3_8B, 1, 1040, 2) / 3.35e12 * 1e3
    assert f"| 1 | 1040 | 6.00 | {bound_ms:.2f} |" in rows[2]


def test_make_models_writes_loadable_configs(tmp_path):
    bench_gpu.make_models(tmp_path)
    llama = ModelConfig.from_path(str(tmp_path / "llama3-8b"))
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim, llama.vocab_size) == (32, 8, 128, 128256)
    small = tmp_path / "smollm2-135m"
    assert json.loads((small / "config.json").read_text())["hidden_size"] == 576
    assert (small / "tokenizer.json").exists()


def test_attention_harness_runs_on_cpu(tmp_path):
    rows = bench_gpu.run_attention(
        ["torch_native", "flashinfer"], torch.float32, torch.device("cpu"), True, 1
    )
    ok = [r for r in rows if r["backend"] == "torch_native"]
    assert len(ok) == len(bench_gpu.SMALL_CASES) and all("error" not in r and r["layer_ms"] > 0 for r in ok)
    failed = [r for r in rows if r["backend"] == "flashinfer"]
    assert all("error" in r for r in failed)  # reported in the table, not raised
    assert "failed:" in bench_gpu.attention_table(rows)
