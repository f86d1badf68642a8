# Session 16 call 1 (new machine, Triton and Inductor caches in new empty folders): the compiled step with
# and without each candidate change, side by side in one process; the row statistics kernel alone; then
# Inductor's flex-attention autotuner on the packed rows (group 4), against train's KERNEL_OPTIONS.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step variants 380 python3 benchmarks/results/2026-12-02-session16/call1/variants.py
grep -h "row stats\|^step\|Error\|error" $OUT/variants.log | head -30
KO=$(python3 -c "import json; from dflash_cache.drafter.attention import KERNEL_OPTIONS as k; print(json.dumps(k))")
step flexauto 200 python3 benchmarks/flex_configs.py --tiles 128 --groups 4 --options "$KO" --autotune --iters 10
grep "^tile" $OUT/flexauto.log; grep -A3 "^AUTOTUNE" $OUT/flexauto.log | cut -c1-260 | head -40
