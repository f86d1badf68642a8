# Session 19 call 2: the head's row statistics split over segments (test, alone against session 18's
# kernel), gradient-norm variants, and the compiled step's matmuls in the step against alone (shapes,
# strides and layouts) with the LM head's chunk sizes.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
D=benchmarks/results/2026-12-03-session19/call2
step gputest 120 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py -k head_loss_kernel -p no:cacheprovider
tail -2 $OUT/gputest.log
step row_stats 120 python3 $D/row_stats.py; cat $OUT/row_stats.log | grep -v Warning | tail -8
step grad_norm 120 python3 $D/grad_norm.py; tail -4 $OUT/grad_norm.log
step step_gemms 330 python3 benchmarks/step_gemms.py --head-chunks 256,512,1024,2048 --rounds 5
cat $OUT/step_gemms.log | cut -c1-200 | grep -v "^ *$" | tail -45
