# Session 7 call C1: four warm-up variants, cold, each in a new process with an empty kernel folder
set -uo pipefail; source .dev/n7/env.sh
tree dry; step tests_dry 60 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/test_fused.py -k "dry_forward or parallel_autotune"
for t in main dry_short main_short dry; do tree $t; step warmup_$t 100 python3 benchmarks/warmup.py --work /tmp/wb_$t --runs cold; done
grep -H "kernels compiled\|cold:" $OUT/warmup_*.log
