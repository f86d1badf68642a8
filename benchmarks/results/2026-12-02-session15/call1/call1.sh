# Session 15 call 1 (new machine, caches pointed at empty folders): where the compiled step's matmul time
# goes (each matmul alone, and cut other ways), flex-attention with each key head's query heads packed into
# its rows against apart, the step with packing (profiled), and AdamW over fp32 master weights.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step gemms 90 python3 benchmarks/gemms.py
grep -v "^ " $OUT/gemms.log | tail -8
step flex 150 python3 benchmarks/flex_configs.py --tiles 128 --options '{"FORCE_USE_FLEX_ATTENTION": true, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_stages": 3, "bwd_num_warps": 4}' --groups 1,4
grep "^tile" $OUT/flex.log | cut -c1-200
step drafter 200 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager \
  --warmup 3 --json $OUT/drafter.json --profile $OUT/prof
rm -f $OUT/prof/*trace.json
grep -h "tokens/s\|warm-up step 3\|Error" $OUT/drafter.log | tail -8
step optimizer 150 python3 benchmarks/optimizer.py
grep -v Warn $OUT/optimizer.log | grep "ms\|TB/s\|Error" | tail -5
