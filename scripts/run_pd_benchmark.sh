#!/usr/bin/env bash
# One prefill + one decode server (one core each) behind sglang-router --pd-disaggregation, then
# one colocated server (both cores), each driven by benchmark/pd/bench_pd_mix.py (short chats with
# 2k-token prompts among them). Results go to $OUT (default /tmp/pd_bench). Everything binds
# 127.0.0.1 and every process started here is stopped on exit.
#   scripts/run_pd_benchmark.sh [extra bench_pd_mix.py args]
set -euo pipefail
PY=${PY:-python}
OUT=${OUT:-/tmp/pd_bench}
MODEL=${MODEL:-default}
POOL=${POOL:-24000}
mkdir -p "$OUT"
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done; sleep 10;
            for p in "${PIDS[@]:-}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
wait_health() {  # url timeout_s
  for _ in $(seq "$2"); do curl -sf -m 2 "$1/health" >/dev/null && return 0; sleep 1; done
  echo "timed out waiting for $1" >&2; return 1
}
common=(--model-path "$MODEL" --host 127.0.0.1 --max-total-tokens "$POOL" --log-level warning)

# --- PD pair: prefill on core 0, decode on core 1
taskset -c 0 $PY -m radixserve.launch_server "${common[@]}" --port 30101 --cpu-threads 1 \
  --disaggregation-mode prefill --disaggregation-bootstrap-port 30198 > "$OUT/prefill.log" 2>&1 &
PIDS+=($!)
taskset -c 1 $PY -m radixserve.launch_server "${common[@]}" --port 30102 --cpu-threads 1 \
  --disaggregation-mode decode > "$OUT/decode.log" 2>&1 &
PIDS+=($!)
wait_health http://127.0.0.1:30101 600; wait_health http://127.0.0.1:30102 600
$PY -m sglang_router.launch_router --pd-disaggregation --prefill http://127.0.0.1:30101 30198 \
  --decode http://127.0.0.1:30102 --host 127.0.0.1 --port 30100 --prometheus-port 30199 \
  --log-level warn > "$OUT/router.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 120); do
  curl -sf -m 30 http://127.0.0.1:30100/generate -H 'content-type: application/json' \
    -d '{"input_ids":[5,6],"sampling_params":{"max_new_tokens":1}}' >/dev/null && break; sleep 1
done
echo "== PD (prefill core 0 + decode core 1, sglang-router)"
$PY benchmark/pd/bench_pd_mix.py --url http://127.0.0.1:30100 --prefill-url http://127.0.0.1:30101 "$@" \
  | tee "$OUT/pd.json"
cleanup; PIDS=()

# --- colocated: one server, both cores
taskset -c 0,1 $PY -m radixserve.launch_server "${common[@]}" --port 30103 --cpu-threads 2 \
  > "$OUT/colocated.log" 2>&1 &
PIDS+=($!)
wait_health http://127.0.0.1:30103 600
echo "== colocated (cores 0-1)"
$PY benchmark/pd/bench_pd_mix.py --url http://127.0.0.1:30103 "$@" | tee "$OUT/colocated.json"
