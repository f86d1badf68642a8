# Issue 15, call 1 (~9 min): the headline first (the user's command cold, then warm, on issue-15-next), every compilation's seconds, then the branch's GPU tests
set -uo pipefail; rm -rf /tmp/cold; source .dev/n9/env.sh
tree next15; step cold_bench 450 python3 benchmarks/extract_cold.py --layers-cut 16 --tokens 1000000 --work /tmp/cold --logs $OUT --json $OUT/cold16.json
rm -rf /tmp/cold
step compile_log 50 python3 benchmarks/warmup.py --work /tmp/wb_log --runs '' --compile-log $OUT/compile_log.json; rm -rf /tmp/wb_log
step tests15 90 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/test_fused.py tests/test_warmup.py tests/test_target_runner.py
grep -h "kernels compiled\|rank 0:" $OUT/extract_*.log; grep -h "ratio\|compile\|mfu" $OUT/cold16.json; grep -h "passed\|failed" $OUT/tests15.log; grep -h "compile log\|  [0-9. ]* s  " $OUT/compile_log.log | head -20
