set -uo pipefail
source .dev/setup.sh 2
s=$SECONDS
timeout 585 python3 benchmarks/extract_cold.py --layers-cut 16 --tokens 1000000 --work /tmp/cold --logs $OUT --json $OUT/cold16.json > $OUT/cold_bench.log 2>&1; echo "extract_cold rc $? $((SECONDS-s)) s"
grep -h "kernels compiled\|rank 0:" $OUT/extract_*.log
tail -25 $OUT/cold_bench.log
