# Session 20 call 2 (every run with new empty Triton and Inductor caches): the compiled step as on main,
# the rotary's half swap as a flip (one layer, call 1's script), then the compiled step with Inductor
# autotuning its matmuls (ATen's cuBLAS call against its Triton templates, persistent TMA ones included),
# each in its own process.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
fresh() { export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d); }
fresh; step compiled 150 python3 benchmarks/drafter.py --modes compiled --json $OUT/compiled.json
grep -h "tokens/s\|warm-up step 5\|Error" $OUT/compiled.log
fresh; step layer_flip 90 python3 benchmarks/results/2026-12-03-session20/call1/layer_variants.py --variants base,flip_rotate --profile
grep -h "first call\|ms  (" $OUT/layer_flip.log
fresh; step compiled_autotune 330 env TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 ENABLE_PERSISTENT_TMA_MATMUL=1 \
  python3 benchmarks/drafter.py --modes compiled --json $OUT/compiled_autotune.json
grep -h "tokens/s\|warm-up step\|Error" $OUT/compiled_autotune.log
grep -c "AUTOTUNE" $OUT/compiled_autotune.log
