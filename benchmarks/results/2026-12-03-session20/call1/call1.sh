# Session 20 call 1 (new machine; Triton and Inductor caches in new empty folders): one decoder layer of
# the 27B drafter, forward + backward compiled, in variants of the model code and Inductor's options.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
D=benchmarks/results/2026-12-03-session20/call1
step layer_sliding 420 python3 $D/layer_variants.py --kind sliding_attention --profile --code \
  --variants base,rope_table,fused_qkv,fused_mlp,strided_kv,rope_table+fused_qkv+fused_mlp+strided_kv,cdt,nomix
grep -v "^\s*$" $OUT/layer_sliding.log | grep -A12 "first call\|median of" | grep -v "^V1\|^\[" | head -40
