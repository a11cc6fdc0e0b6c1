#!/usr/bin/env bash
# Issue #7's GPU checks, run ON the device machine from the repository root (docs/gpu.md):
#   tests       the GPU-marked tests: triton kernels/backend in bf16, CUDA graphs on/off and overlap
#               on/off greedy parity with HF, no host sync in a decode launch        (~5 min)
#   bench       attention kernel times (triton vs torch_native), bs=1/64 decode on dummy Llama-3-8B
#               weights against the HBM bound, overlap on vs off on a small model      (~6 min)
#   flashinfer  flashinfer parity tests and kernel times (needs .whl_fi/ carried)
# Everything it prints is also written under $OUT (the device tool brings that folder back).
set -uo pipefail
what=${1:?usage: run_checks.sh tests|bench|flashinfer}
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
site=/tmp/site
install() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$@"
}
if [ -d .whl ]; then install .whl/*.whl || exit 1; fi
if [ "$what" = flashinfer ]; then
    [ -d .whl_fi ] || { echo "carry .whl_fi (scripts/gpu/prepare.py --flashinfer)"; exit 2; }
    install .whl_fi/*.whl || exit 1
fi
export PYTHONPATH="$site:$PWD/python:$PWD/sgl-kernel" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"

case "$what" in
tests)
    python3 -m pytest -m gpu -p no:cacheprovider -q -ra --timeout 540 test/kernels test/engine 2>&1 \
        | tee "$OUT/gpu_tests.log"
    ;;
bench)
    python3 benchmark/bench_gpu.py attention --backends torch_native triton --out "$OUT/attention.md"
    python3 -m radixserve.bench_one_batch --model-path .gpu_models/llama3-8b --load-format dummy \
        --batch-size 1 64 --input-len 1024 --output-len 32 --result-file "$OUT/decode.jsonl" \
        | tee "$OUT/decode.log"
    python3 benchmark/bench_gpu.py ceiling --config .gpu_models/llama3-8b --result-file "$OUT/decode.jsonl" \
        --hbm-tb-per-s "${HBM_TB_PER_S:-3.35}" --out "$OUT/ceiling.md"
    for overlap in on off; do
        args='{"load_format": "dummy"}'
        [ $overlap = off ] && args='{"load_format": "dummy", "disable_overlap_schedule": true}'
        python3 -m radixserve.bench_offline_throughput --model-path .gpu_models/smollm2-135m \
            --server-args "$args" --num-prompts 256 --random-input-len 256 --random-output-len 256 \
            --result-file "$OUT/overlap_$overlap.jsonl" 2>&1 | tail -14 | tee "$OUT/overlap_$overlap.log"
    done
    ;;
flashinfer)
    python3 -m pytest -m gpu -p no:cacheprovider -q -ra test/kernels/test_flashinfer_backend.py 2>&1 \
        | tee "$OUT/flashinfer_tests.log"
    python3 benchmark/bench_gpu.py attention --backends flashinfer triton --out "$OUT/attention_flashinfer.md"
    ;;
*)
    echo "unknown check: $what"; exit 2 ;;
esac
