# Session 14 call B (after call A on the same machine): flex-attention's FLASH backend (flash-attn-4) against
# the landed Triton kernel options, one attention layer of each kind, then the drafter's whole step.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh; source benchmarks/results/2026-12-02-session14/callAB/fa4_env.sh
KO='{"FORCE_USE_FLEX_ATTENTION": true, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_stages": 3, "bwd_num_warps": 4}'
step flex 180 python3 benchmarks/flex_configs.py --tiles 128 --options "$KO" '{"BACKEND": "FLASH"}'
grep -h "^tile\|Error" $OUT/flex.log | head -20
step flash_compiled 150 python3 benchmarks/results/2026-12-02-session14/callAB/fa4_step.py --modes compiled --json $OUT/flash_compiled.json
grep -h "tokens/s\|warm-up step 5\|Error" $OUT/flash_compiled.log | head -5
step triton_compiled 90 python3 benchmarks/drafter.py --modes compiled --json $OUT/triton_compiled.json
grep -h "tokens/s\|warm-up step 5\|Error" $OUT/triton_compiled.log | head -5
step flash_eager 110 python3 benchmarks/results/2026-12-02-session14/callAB/fa4_step.py --modes eager --json $OUT/flash_eager.json
grep -h "tokens/s\|warm-up step 5\|Error" $OUT/flash_eager.log | head -5
