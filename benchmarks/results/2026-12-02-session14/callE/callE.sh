# Session 14 call E (for the next session): the optimizer step against its memory floor, and flex-attention
# on 64-query tiles (fewer masked-out pairs) against 128, with the tuned backward tiles.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
step optimizer 70 python3 benchmarks/optimizer.py
cat $OUT/optimizer.log | grep -v Warn
KO='"FORCE_USE_FLEX_ATTENTION": true, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_stages": 3, "bwd_num_warps": 4'
step flex128 60 python3 benchmarks/flex_configs.py --tiles 128 --options "{$KO}"
step flex64 70 python3 benchmarks/flex_configs.py --tiles 64 --options "{$KO, \"fwd_BLOCK_M\": 64, \"fwd_BLOCK_N\": 64}"
grep -h "^tile" $OUT/flex128.log $OUT/flex64.log
