# Session 21 call 1 (new machine; Triton and Inductor caches in new empty folders):
# the matmul rate after idle against sustained, with clocks and power; the head's logits through a
# matmul tuned on its own against cuBLAS (session 20's next/head_logits.py).
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
D=benchmarks/results/2026-12-03-session21/call1
step sustained_gemm 120 python3 $D/sustained_gemm.py --seconds 6 --csv $OUT/clocks.csv
cat $OUT/sustained_gemm.log
awk -F', ' 'NR>1 {print $2, $4, $6}' $OUT/clocks.csv | sort | uniq -c | sort -rn | head -12
step head_logits 300 python3 benchmarks/results/2026-12-03-session20/next/head_logits.py --rounds 5 --iters 5
grep -v Warning $OUT/head_logits.log | tail -8
