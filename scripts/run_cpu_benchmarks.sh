#!/usr/bin/env bash
# Reproduces the CPU numbers in docs/benchmarks.md (built-in model). Run on an otherwise idle box:
# two cores are shared, and any other process skews every number. The side-by-side comparison with
# llama.cpp and HF transformers is separate: benchmark/compare_peers.py --repeats 3.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-/tmp/radixserve-bench}
mkdir -p "$OUT"

echo "== bench_one_batch (static batch, vs HF transformers generate)"
$PY -m radixserve.bench_one_batch --batch-size 1 8 32 64 --input-len 128 --output-len 64 --hf \
  --result-file "$OUT/one_batch.jsonl"

echo "== each CPU fast path off in turn (static batch 1 and 64)"
for cfg in '{}' '{"cpu_fp16_weights": true}' '{"disable_cpu_fused_decode": true}' \
  '{"disable_cpu_weight_prepack": true}' '{"attention_backend": "torch_native"}'; do
  $PY -m radixserve.bench_one_batch --batch-size 1 64 --input-len 128 --output-len 64 \
    --server-args "$cfg" --result-file "$OUT/ablation.jsonl"
done
if $PY -c 'import sys; from radixserve.layers.linear import bf16_gemm_supported as s; sys.exit(not s())'; then
  $PY -m radixserve.bench_one_batch --batch-size 1 64 --input-len 128 --output-len 64 \
    --server-args '{"cpu_bf16_gemm": true}' --result-file "$OUT/ablation.jsonl"
else
  echo "(skipping --cpu-bf16-gemm: this CPU has no native bf16 GEMM)"
fi
RADIXSERVE_DISABLE_CPU_KERNELS=1 $PY -m radixserve.bench_one_batch --batch-size 1 64 --input-len 128 \
  --output-len 64 --server-args '{"disable_cpu_weight_prepack": true}' --result-file "$OUT/ablation.jsonl"

echo "== --quantization w8a8_int8 vs fp32 (static batch 1 and 16; docs/quantization.md)"
for cfg in '{}' '{"quantization": "w8a8_int8"}' '{"quantization": "w8a8_int8", "cpu_fp16_weights": true}'; do
  $PY -m radixserve.bench_one_batch --batch-size 1 16 --input-len 128 --output-len 64 \
    --server-args "$cfg" --result-file "$OUT/int8.jsonl"
done

echo "== sgl-kernel CPU kernels vs what they replace"
$PY benchmark/bench_cpu_kernels.py
$PY benchmark/bench_int8_linear.py
$PY benchmark/bench_cpu_kernels.py --only extend

echo "== scheduler CPU per step (null worker)"
$PY benchmark/bench_scheduler_overhead.py --batch-size 64

echo "== offline throughput 64 x 128/128, overlap on vs off"
for overlap in false true; do
  $PY -m radixserve.bench_offline_throughput --num-prompts 64 --random-input-len 128 \
    --random-output-len 128 --random-range-ratio 1.0 \
    --server-args "{\"disable_overlap_schedule\": $([ $overlap = true ] && echo false || echo true), \"log_level\": \"warning\"}" \
    --result-file "$OUT/offline.jsonl"
done

echo "== shared prefix 8 groups x 8 prompts, 1024-token prefix, 64-token question, 64 out: radix on vs off"
for radix in on off; do
  $PY -m radixserve.bench_offline_throughput --dataset-name generated-shared-prefix \
    --server-args "{\"disable_radix_cache\": $([ $radix = off ] && echo true || echo false), \"log_level\": \"warning\"}" \
    --result-file "$OUT/shared_prefix.jsonl"
done
