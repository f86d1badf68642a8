# Session 19 call 1 (new machine; Triton and Inductor caches in new empty folders): where the compiled
# 27B step's non-matmul time goes (GPU time by kind), flex-attention with its partial tiles unmasked,
# and attention kernels' own rates at the step's pair count.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step drafter 240 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled \
  --json $OUT/drafter.json --profile $OUT/prof
grep -h "tokens/s\|Error" $OUT/drafter.log; sed -n '/GPU time by kind/,/^---/p' $OUT/drafter.log | head -45
rm -f $OUT/prof/*trace.json
KO=$(python3 -c "import json; from dflash_cache.drafter.attention import KERNEL_OPTIONS as k; print(json.dumps(k))")
step flex 150 python3 benchmarks/flex_configs.py --tiles 128 --groups 4 --mask-mods intervals,unmasked --options "$KO"
grep "^tile" $OUT/flex.log | cut -c1-200; grep -i "error" $OUT/flex.log | head -5
step dense 90 python3 benchmarks/results/2026-12-03-session19/call1/dense_rates.py
cat $OUT/dense.log | tail -5
