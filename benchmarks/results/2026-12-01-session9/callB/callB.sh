# Issue 15, session 9 call B (~8 min): the headline alone on issue-15-next (extract_cold: cold, warm, bare forward), then its warm-up GPU tests
set -uo pipefail; rm -rf /tmp/cold /tmp/wb; source .dev/n9/env.sh
tree next15; step cold_bench 470 python3 benchmarks/extract_cold.py --layers-cut 16 --tokens 1000000 --work /tmp/cold --logs $OUT --json $OUT/cold16.json
rm -rf /tmp/cold
step tests15 70 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/test_warmup.py tests/test_fused.py
grep -h "kernels compiled\|rank 0:" $OUT/extract_*.log; grep -h "ratio\|compile\|mfu\|tok_s" $OUT/cold16.json; grep -h "passed\|failed" $OUT/tests15.log
