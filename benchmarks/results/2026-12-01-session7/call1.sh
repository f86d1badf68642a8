# Session 7 call A: the process-pool warm-up (tests, then cold/warm beside main's), eager recompiles over 500 steps
set -uo pipefail; source .dev/n7/env.sh
tree procs; step tests_procs_autotune 70 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/test_fused.py -k "dry_forward or parallel_autotune"
tree procs; step tests_procs_fused 90 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/test_fused.py -k "not dry_forward and not parallel_autotune"
tree procs; step warmup_procs 130 python3 benchmarks/warmup.py --work /tmp/wb_procs
tree main;  step warmup_main 100 python3 benchmarks/warmup.py --work /tmp/wb_main
tree main;  step recompiles_eager 180 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 8192 --anchors 256 --steps 500 --modes eager --json $OUT/recompiles_eager.json
grep -h "passed\|failed\|Error" $OUT/tests_*.log | tail -5; grep -h "kernels compiled\|cold:\|warm:" $OUT/warmup_*.log; grep -h "recompil\|eager " $OUT/recompiles_eager.log | tail -4
