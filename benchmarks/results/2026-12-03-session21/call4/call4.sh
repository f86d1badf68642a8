# Session 21 call 4 (call 3's machine; Triton and Inductor caches in new empty folders): the eager drafter
# beside the peer (calls 2 and 3 cut it with their own limits). Sent as one command line.
mkdir -p $OUT && set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1; export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d); step drafter 290 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes eager --peer "$PEER" --json $OUT/drafter.json; grep -v "Warn\|warn" $OUT/drafter.log | tail -8
