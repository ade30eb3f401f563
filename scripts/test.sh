#!/usr/bin/env bash
# The whole test suite, once, in two lanes (docs/testing.md): the fast lane first, stopping at its first failure,
# then the slow lane (the end-to-end runs); tests.lanes then checks that the two lanes ran every collected test
# exactly once; each lane lists its 25 slowest tests (--durations), so a CI log shows where the time went. Extra
# arguments go to both pytest calls. With FLEETRL_STRICT_SKIPS=1 (.ci/run sets it) a skip that
# tests/skip_policy.py does not expect fails the lane. Each lane runs on FLEETRL_TEST_WORKERS pytest-xdist workers
# (2 by default, 0 for one plain process), each taking whole modules (tests/workers.py).
set -euo pipefail
cd "$(dirname "$0")/.."
lanes=$(mktemp -d)
workers=${FLEETRL_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != 0 ]; then
  parallel=(-n "$workers")
fi
fast_start=$(date +%s)
FLEETRL_LANE_RECORD="$lanes/fast.json" python -m pytest -q -m "not slow" -x --durations=25 "${parallel[@]}" "$@"
echo "tests: fast lane done in $(( $(date +%s) - fast_start )) s"
slow_start=$(date +%s)
FLEETRL_LANE_RECORD="$lanes/slow.json" python -m pytest -q -m slow --durations=25 "${parallel[@]}" "$@"
echo "tests: slow lane done in $(( $(date +%s) - slow_start )) s"
python -m tests.lanes "$lanes/fast.json" "$lanes/slow.json"
