# Session 17 call 1 (Triton and Inductor caches in new empty folders): flex-attention alone with the
# interval mask function and the USE_TMA option, then the compiled step with each, side by side.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
KO=$(python3 -c "import json; from dflash_cache.drafter.attention import KERNEL_OPTIONS as k; print(json.dumps(k))")
KT=$(python3 -c "import json; from dflash_cache.drafter.attention import KERNEL_OPTIONS as k; print(json.dumps(dict(k, USE_TMA=True)))")
step flex 210 python3 benchmarks/flex_configs.py --tiles 128 --groups 4 --mask-mods rule,intervals --options "$KO" "$KT"
grep "^tile" $OUT/flex.log | cut -c1-220; grep -i "error" $OUT/flex.log | head -5
step variants 330 python3 benchmarks/results/2026-12-02-session17/call1/variants.py
grep "^step" $OUT/variants.log | cut -c1-300; grep -i "error" $OUT/variants.log | head -5
