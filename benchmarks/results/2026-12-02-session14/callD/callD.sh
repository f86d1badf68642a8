# Session 14 call D (the machine of call C, caches pointed at empty folders): the peer, compiled and eager in
# one process with the head-loss kernel; then both 200-step recompilation audits.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step drafter 300 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager \
  --json $OUT/drafter.json --peer "$PEER"
grep -h "peer:\|tokens/s\|warm-up step 5" $OUT/drafter.log
step recompiles 250 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 \
  --modes compiled,eager --progress 50 --json $OUT/recompiles.json
grep -v "^  " $OUT/recompiles.log | tail -6
