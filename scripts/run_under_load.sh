#!/usr/bin/env bash
# Issue 35's load check: the distributed and speculative suites, slow tests included, run RUNS
# times with one process spinning on a core beside them (the way a build or another tenant's job
# sits beside a test run). Each run's pytest summary line goes to stdout; full logs to LOG_DIR.
#
#     scripts/run_under_load.sh              # 3 runs, logs in /tmp/load_runs
#     RUNS=1 scripts/run_under_load.sh -k tp2   # extra pytest arguments pass through
#
# (pyproject's addopts already pass -q: a second -q would drop the summary line.)
# Run it on an otherwise idle machine: the check is "passes beside one spinner", not beside an
# arbitrary load (docs/testing.md, "Runs under load").
set -uo pipefail
cd "$(git rev-parse --show-toplevel)"
RUNS=${RUNS:-3}
LOG_DIR=${LOG_DIR:-/tmp/load_runs}
PY=${PY:-.venv/bin/python}
mkdir -p "$LOG_DIR"
SUITES=(test/distributed test/engine/test_speculative*.py test/engine/test_moe_speculative.py
        test/server/test_speculative_engine.py test/unit/test_speculative*.py)
python3 -c 'while True: pass' &
spinner=$!
trap 'kill $spinner 2>/dev/null' EXIT
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), load before: $(cut -d' ' -f1-3 /proc/loadavg)"
status=0
for i in $(seq 1 "$RUNS"); do
    start=$(date +%s)
    HF_HUB_OFFLINE=1 "$PY" -m pytest "${SUITES[@]}" -p no:cacheprovider "$@" > "$LOG_DIR/run$i.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || status=1
    echo "run $i: exit $rc in $(( $(date +%s) - start )) s: $(tail -1 "$LOG_DIR/run$i.log")"
done
exit $status
