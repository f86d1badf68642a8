# Session 13 call 3, main at 75b4c3c with the benchmark drafter built on the GPU: the peer, compiled and
# eager in one process; the compiled recompilation audit (call 1 ran out of time in it); then the
# interval mask function (call2/variants.py imask), compiled, against this call's compiled figure
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
step drafter 290 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager \
  --json $OUT/drafter.json --peer "$PEER"
grep -h "peer:\|tokens/s\|warm-up step 5" $OUT/drafter.log
step recompiles 150 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 \
  --modes compiled --progress 50 --json $OUT/recompiles.json
grep -v "^  " $OUT/recompiles.log | tail -3
step imask 100 python3 benchmarks/results/2026-12-02-session13/call2/variants.py imask compiled
grep -h "^RESULT" $OUT/imask.log
