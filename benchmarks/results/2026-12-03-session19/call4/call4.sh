# Session 19 call 4 (Triton and Inductor caches in new empty folders): the head kernel's GPU test, the
# issue's command beside the peer with the segment kernel, and the compiled recompilation audit.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step gputest 60 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py -k "head_loss_kernel or compiled_adamw" -p no:cacheprovider
tail -1 $OUT/gputest.log
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step drafter 300 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager \
  --json $OUT/drafter.json --peer "$PEER"
grep -h "peer:\|tokens/s\|warm-up step 5\|Error" $OUT/drafter.log
step recompiles_compiled 190 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes compiled --progress 50 --json $OUT/recompiles_compiled.json
tail -3 $OUT/recompiles_compiled.log
