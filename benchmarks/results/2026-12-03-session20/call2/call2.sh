# Session 20 call 2 (every run with new empty Triton and Inductor caches): the command for the
# compiled step beside the peer, as on main; then the same with Inductor autotuning the step's matmuls
# (ATen's cuBLAS call against Inductor's Triton templates, persistent TMA ones included), in its own process.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
fresh() { export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d); }
fresh; step compiled 220 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled \
  --json $OUT/compiled.json --peer "$PEER"
grep -h "peer:\|tokens/s\|warm-up step 5\|Error" $OUT/compiled.log
fresh; step compiled_autotune 340 env TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 ENABLE_PERSISTENT_TMA_MATMUL=1 \
  python3 benchmarks/drafter.py --modes compiled --json $OUT/compiled_autotune.json
grep -h "tokens/s\|warm-up step\|Error" $OUT/compiled_autotune.log
grep -c "AUTOTUNE" $OUT/compiled_autotune.log
