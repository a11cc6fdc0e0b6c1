#!/usr/bin/env bash
# Reproduces the tensor/pipeline-parallel numbers in docs/benchmarks.md ("Multi-rank") on this CPU,
# built-in model: the collectives per call (gloo vs shared memory), bench_one_batch per decode
# step at TP=1 / TP=2 (shm and gloo) / PP=2, and served throughput at each layout side by side.
# Run on an otherwise idle machine: the ranks are pinned one per core.
# Usage: scripts/run_parallel_benchmarks.sh [collectives] [static] [serving]   (default: all three)
set -euo pipefail
SECTIONS=${*:-collectives static serving}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-/tmp/radixserve-parallel-bench}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1

if want collectives; then
  echo "== collectives per call, 2 ranks pinned to one core each"
  $PY benchmark/bench_all_reduce.py | tee "$OUT/all_reduce.md"
fi

static() {
  echo "== static batch per layout (decode step latency, prefill)"
  for cfg in '{}' '{"tp_size": 2}' '{"tp_size": 2, "disable_custom_all_reduce": true}' '{"pp_size": 2}'; do
    $PY -m radixserve.bench_one_batch --batch-size 1 16 64 --input-len 128 --output-len 64 \
      --server-args "$cfg" --result-file "$OUT/one_batch.jsonl"
  done
}
if want static; then static; fi

serving() {
  echo "== served: random 128 in / 128 out, concurrency 1 and 16, per layout"
  PORT=31999
  for layout in "" "--tp-size 2" "--tp-size 2 --disable-custom-all-reduce" "--pp-size 2"; do
    # shellcheck disable=SC2086
    $PY -m radixserve.launch_server --port $PORT --log-level warning $layout &
    SERVER=$!
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 1; done
    for conc in 1 16; do
      echo "-- layout '${layout:-tp 1}' concurrency $conc"
      $PY -m radixserve.bench_serving --backend radixserve --port $PORT --dataset-name random-ids \
        --num-prompts $((conc == 1 ? 16 : 64)) --random-input-len 128 --random-output-len 128 \
        --random-range-ratio 1.0 --max-concurrency $conc --seed 1 --disable-tqdm \
        --output-file "$OUT/serving.jsonl"
    done
    kill $SERVER
    wait $SERVER || true
  done
}
if want serving; then serving; fi
