# Session 17 call 2 (Triton and Inductor caches in new empty folders): the GPU test of the mask against
# the dense reference; the step with the mask function as the rule and as intervals, compiled then eager;
# the LM head's matmuls per chunk; a profile of the compiled step (the library's code).
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step gputest 100 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py -k "fused_kernel_equals_dense or fused_flex_matches" -p no:cacheprovider
tail -2 $OUT/gputest.log
step compiled 200 python3 benchmarks/results/2026-12-02-session17/call2/variants.py --mode compiled
step eager 130 python3 benchmarks/results/2026-12-02-session17/call2/variants.py --mode eager
grep -h "^step" $OUT/compiled.log $OUT/eager.log | cut -c1-300; grep -ih "error" $OUT/compiled.log $OUT/eager.log | head -5
step head 60 python3 benchmarks/results/2026-12-02-session17/call2/head_gemms.py
cat $OUT/head.log
