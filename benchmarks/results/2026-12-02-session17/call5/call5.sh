# Session 17 call 5 (on call 4's machine): the GPU tests that call 2 had not run.
source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1; step gputests 340 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py -p no:cacheprovider -k "not fused_kernel_equals_dense and not fused_flex_matches"; tail -6 $OUT/gputests.log
