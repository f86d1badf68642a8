# Session 19 call 3: the segment kernel's segments and warps; call 2's gradient-norm and step-matmul
# scripts, mended (a parameter's gradient dtype; mm's out= operand).
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step row_stats 150 python3 benchmarks/results/2026-12-03-session19/call3/row_stats.py; grep -v Warn $OUT/row_stats.log | tail -8
step grad_norm 120 python3 benchmarks/results/2026-12-03-session19/call2/grad_norm.py; tail -4 $OUT/grad_norm.log
step step_gemms 330 python3 benchmarks/step_gemms.py --head-chunks 256,512,1024,2048 --rounds 5
cat $OUT/step_gemms.log | cut -c1-200 | grep -v "^ *$\|Warn\|_warn" | tail -45
