# Session 13 call 1, main at 75b4c3c: the peer, compiled and eager in one process (no profile); then the
# 200-step recompilation audit of both modes, with the GPU tests running beside it (the audit counts
# compilations; its ms/step is not a figure)
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
step drafter 260 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager \
  --json $OUT/drafter.json --peer "$PEER"
timeout 200 python3 -m pytest -q -m gpu -rA --tb=short -p no:cacheprovider -p no:logging --durations=10 \
  tests/test_drafter_gpu.py > $OUT/gputests.log 2>&1 &
step recompiles 230 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 \
  --modes eager,compiled --progress 50 --json $OUT/recompiles.json
wait
grep -h "peer:\|tokens/s\|warm-up step 5" $OUT/drafter.log; grep -v "^  " $OUT/recompiles.log | tail -6
grep -v "^DEBUG\|^  \|^$" $OUT/gputests.log | tail -14
