# For the next session (not run yet), on a new machine: the drafter's whole GPU test file, then the compiled
# drafter's recompilation audit over 200 steps with the Triton norm-rotary pass (session 21 ran only the
# eager one). Limits sized from session 21's runs, where 100-330 s limits cut three runs short.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step gputest 330 python3 -m pytest -m gpu -q tests/test_drafter_gpu.py
grep -E "passed|failed|error" $OUT/gputest.log | tail -3
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step recompiles_compiled 230 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes compiled --progress 50 --json $OUT/recompiles_compiled.json
tail -3 $OUT/recompiles_compiled.log
# the card's sustained matmul rate under its power cap, on this machine too (session 21 call 1 saw 667 TFLOP/s
# held against 790 in the first windows)
step sustained_gemm 60 python3 benchmarks/results/2026-12-03-session21/call1/sustained_gemm.py --seconds 6 --csv $OUT/clocks.csv
cat $OUT/sustained_gemm.log
