#!/usr/bin/env bash
# Run CI exactly as it runs: a fresh clone of the committed tree, then .ci/run.
set -euo pipefail
d=$(mktemp -d)
git clone -q "$(git rev-parse --show-toplevel)" "$d"
cd "$d" && time bash .ci/run
