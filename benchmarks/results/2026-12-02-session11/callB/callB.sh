# Session 11 call B: the regions' GPU test; the peer, eager and compiled (masks in its graph, head chunks of whole tiles);
# the 200-step recompilation audit of both modes
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
step regionstest 100 python3 -m pytest -x -q -m gpu -rA --tb=short -p no:cacheprovider tests/test_drafter_gpu.py -k regions
step drafter 230 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes eager,compiled \
  --profile /tmp/prof --json $OUT/drafter.json --peer "$PEER"
cp /tmp/prof/drafter_compiled_profile.txt $OUT/ 2>/dev/null
step recompiles 230 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 \
  --modes eager,compiled --json $OUT/recompiles.json
tail -4 $OUT/regionstest.log; grep -h "peer\|tokens/s" $OUT/drafter.log; grep -v "^  " $OUT/recompiles.log | tail -8
