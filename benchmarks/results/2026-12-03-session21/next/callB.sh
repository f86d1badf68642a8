# For the next session (not run yet): both modes beside the peer in one process, as the condition
# asks (session 21 had them in two calls), with a limit that fits the peer (~120 s) and both cold warm-ups
# (compiled ~100 s, eager ~90 s) and their steps.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step drafter 480 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager --peer "$PEER" --json $OUT/drafter.json
grep -v "warm-up step\|Warn\|warn" $OUT/drafter.log | tail -4
