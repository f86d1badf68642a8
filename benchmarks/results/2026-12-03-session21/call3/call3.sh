# Session 21 call 3 (call 2's machine; Triton and Inductor caches in new empty folders): the Triton pass's
# own GPU test and the eager regions' test, the eager drafter's recompilation audit over 200 steps of
# distinct shapes, and the eager drafter beside the peer (call 2's run was cut by its own limit there).
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step gputest 100 python3 -m pytest -m gpu -q tests/test_drafter_gpu.py -k "norm_rotate_pack or eager_regions_match or without_anchors"
tail -3 $OUT/gputest.log
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step recompiles_eager 200 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes eager --progress 50 --json $OUT/recompiles_eager.json
tail -4 $OUT/recompiles_eager.log
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step drafter 250 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes eager --peer "$PEER" --json $OUT/drafter.json
grep -v "warm-up step\|Warn" $OUT/drafter.log | tail -4
