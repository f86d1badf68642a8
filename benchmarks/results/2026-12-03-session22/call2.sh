# Session 22 call 2 (call 1's machine; caches in new empty folders): the compiled drafter's recompilation
# audit over 200 steps of distinct shapes with the norm-rotary pass, then the drafter's whole GPU test file.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step recompiles_compiled 240 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes compiled --progress 50 --json $OUT/recompiles_compiled.json
tail -4 $OUT/recompiles_compiled.log
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step gputest 340 python3 -m pytest -m gpu -q -rs --durations=15 tests/test_drafter_gpu.py
grep -E "passed|failed|error|SKIP|s call" $OUT/gputest.log | tail -25
