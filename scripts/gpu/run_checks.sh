#!/usr/bin/env bash
# Issue #7's GPU checks, run ON the device machine from the repository root (docs/gpu.md):
#   tests       the GPU-marked tests: triton kernels/backend in bf16, CUDA graphs on/off and overlap
#               on/off greedy parity with HF, no host sync in a decode launch        (~5 min)
#   bench       = lease attention decode overlap
#   flashinfer  = lease flashinfer (needs .whl_fi/ carried)
#   lease [STEP...]  for a 15-minute lease: steps tests (every test that runs Triton on CUDA, not
#               only the gpu-marked ones, in parallel), attention, decode, overlap (the default
#               four), overlap8b (overlap on/off on Llama-3-8B shapes), profile, serving_profile
#               (py-spy of the scheduler under load, overlap off and on) and flashinfer, each
#               under its own timeout; $OUT gets results.tgz
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
export PYTHONPATH="$site:$PWD/python:$PWD/sgl-kernel" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PATH="$site/bin:$PATH"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"

python3 -c 'import transformers; print("transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"

# Every test file whose kernels run on CUDA when a GPU is present (gpu-marked or not).
CUDA_TESTS="test/kernels/test_triton_attention.py test/kernels/test_triton_wq_gemm.py
    test/kernels/test_triton_lora.py test/kernels/test_fused_ops.py test/kernels/test_fused_moe_triton.py
    test/engine/test_speculative_trees_triton.py test/engine/test_cuda_graph_runner.py
    test/engine/test_overlap_cuda.py"
step() {  # step SECONDS NAME CMD...: one step under its own limit, logged under $OUT
    local limit=$1 name=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -20
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
    # The tool brings back at most 8 files: everything also goes into one archive, after each step
    # so a call cut off at its limit still returns what finished.
    [ -n "${RES:-}" ] && tar czf /tmp/results.tgz -C "$OUT" . && mv /tmp/results.tgz "$RES/"
}
overlap_run() {  # overlap_run on|off [MODEL_DIR NUM_PROMPTS INPUT_LEN OUTPUT_LEN]
    args='{"load_format": "dummy"}'
    [ "$1" = off ] && args='{"load_format": "dummy", "disable_overlap_schedule": true}'
    python3 -m radixserve.bench_offline_throughput --model-path "${2:-.gpu_models/smollm2-135m}" \
        --server-args "$args" --num-prompts "${3:-256}" --random-input-len "${4:-256}" \
        --random-output-len "${5:-256}" --result-file "$OUT/overlap_$1${2:+_8b}.jsonl"
}

case "$what" in
lease)
    # Logs go to a scratch folder; $OUT gets one archive of it (updated after every step).
    RES=$OUT
    OUT=/tmp/lease
    mkdir -p "$OUT" && cp "$RES/gpu.txt" "$OUT/"
    export -f overlap_run
    export OUT
    shift
    steps=${*:-tests attention decode overlap}
    for s in $steps; do
        case $s in
        tests)  # xdist (on the machine's image): Triton's compiles spread over its 16 cores
            step 200 gpu_tests python3 -m pytest -p no:cacheprovider -q -ra -n 8 --timeout 150 $CUDA_TESTS
            ;;
        attention)
            step 45 attention python3 benchmark/bench_gpu.py attention --backends torch_native triton \
                --out "$OUT/attention.md"
            ;;
        decode)
            step 120 decode python3 -m radixserve.bench_one_batch --model-path .gpu_models/llama3-8b \
                --load-format dummy --batch-size 1 64 --input-len 1024 --output-len 32 \
                --result-file "$OUT/decode.jsonl"
            step 20 ceiling python3 benchmark/bench_gpu.py ceiling --config .gpu_models/llama3-8b \
                --result-file "$OUT/decode.jsonl" --hbm-tb-per-s "${HBM_TB_PER_S:-4.8}" --out "$OUT/ceiling.md"
            ;;
        overlap)
            step 60 overlap_on bash -c 'overlap_run on'
            step 60 overlap_off bash -c 'overlap_run off'
            ;;
        profile)  # host vs kernel time of a decode step, and the kernels (8B shapes, bs 1 and 64)
            step 120 profile python3 benchmark/profile_gpu_decode.py --model-path .gpu_models/llama3-8b \
                --batch-size 1 64 --out "$OUT/profile.md"
            step 60 tree_mask_diff python3 -m pytest -p no:cacheprovider -q -s \
                test/kernels/test_triton_attention.py -k tree_mask
            ;;
        overlap8b)  # where the GPU's step is as long as the CPU's: the regime overlap is for
            step 75 overlap8b_on bash -c 'overlap_run on .gpu_models/llama3-8b-tok 128 512 128'
            step 75 overlap8b_off bash -c 'overlap_run off .gpu_models/llama3-8b-tok 128 512 128'
            ;;
        serving_profile)  # the scheduler under load on Llama-3-8B shapes, overlap off then on (py-spy)
            for mode in off on; do
                flags="--model-path .gpu_models/llama3-8b-tok --load-format dummy"
                [ $mode = off ] && flags="$flags --disable-overlap-schedule"
                step 130 serving_profile_$mode python3 benchmark/profile_serving.py --concurrency 128 \
                    --num-prompts 4000 --input-len 512 --output-len 128 --warmup-s 20 --duration 15 \
                    --server-flags "$flags"
            done
            ;;
        flashinfer)  # its JIT kernels compile with nvcc on first use (minutes)
            install .whl_fi/*.whl || exit 1
            step 200 flashinfer_tests python3 -m pytest -p no:cacheprovider -q -ra --timeout 190 \
                test/kernels/test_flashinfer_backend.py
            step 60 attention_flashinfer python3 benchmark/bench_gpu.py attention --backends flashinfer triton \
                --out "$OUT/attention_flashinfer.md"
            ;;
        *) echo "unknown lease step: $s"; exit 2 ;;
        esac
    done
    cat "$OUT"/attention*.md "$OUT"/ceiling.md 2>/dev/null
    grep -h "Output token throughput" "$OUT"/overlap_*.log 2>/dev/null
    tail -n 3 "$OUT"/*tests.log 2>/dev/null
    ;;
tests)
    python3 -m pytest -m gpu -p no:cacheprovider -q -ra --timeout 540 test/kernels test/engine 2>&1 \
        | tee "$OUT/gpu_tests.log"
    ;;
bench)  # shorthands for lease steps (results in $OUT/results.tgz)
    exec bash "$0" lease attention decode overlap
    ;;
flashinfer)
    exec bash "$0" lease flashinfer
    ;;
*)
    echo "unknown check: $what"; exit 2 ;;
esac
