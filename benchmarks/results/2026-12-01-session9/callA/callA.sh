# Issue 15, session 9 call A (~9.5 min): the side process's cold warm-up alone, launchers built in the pool (next15) or not (next15b), alternating twice;
# then the headline (extract_cold, cold then warm) on the faster tree; then its warm-up GPU tests
set -uo pipefail; rm -rf /tmp/cold /tmp/wb; source .dev/n9/env.sh
for i in 1 2; do for t in next15b next15; do tree $t; step wb_${t}_$i 100 python3 benchmarks/warmup.py --work /tmp/wb --runs cold; rm -rf /tmp/wb; done; done
secs() { cat $OUT/wb_$1_*.log | sed -n 's/.*ahead, on a .*: \([0-9.]*\) s (.*/\1/p' | awk '{s+=$1} END {print (NR==2 ? s : 9999)}'; }
a=$(secs next15); b=$(secs next15b); echo "side process, sum of two cold runs: next15 $a s, next15b $b s"
best=next15b; if awk "BEGIN {exit !($a < $b)}"; then best=next15; fi; echo "headline on $best"
tree $best; step cold_bench 420 python3 benchmarks/extract_cold.py --layers-cut 16 --tokens 1000000 --work /tmp/cold --logs $OUT --json $OUT/cold16.json
rm -rf /tmp/cold
step tests15 60 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/test_warmup.py tests/test_fused.py
grep -h "ahead" $OUT/wb_*.log; grep -h "kernels compiled\|rank 0:" $OUT/extract_*.log; grep -h "ratio\|compile\|mfu" $OUT/cold16.json; grep -h "passed\|failed" $OUT/tests15.log
