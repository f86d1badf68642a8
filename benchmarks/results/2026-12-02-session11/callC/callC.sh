# Session 11 call C: the regions' GPU test at head size 32; the peer, then compiled and eager in one process
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
step regionstest 60 python3 -m pytest -x -q -m gpu -rA --tb=line -p no:cacheprovider tests/test_drafter_gpu.py -k regions
step drafter 270 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager \
  --json $OUT/drafter.json --peer "$PEER"
tail -3 $OUT/regionstest.log; grep -h "peer\|tokens/s\|warm-up step 5" $OUT/drafter.log
