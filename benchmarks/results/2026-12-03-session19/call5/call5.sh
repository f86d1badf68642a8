# Session 19 call 5: the eager recompilation audit; the compiled step's matmuls in the step against alone.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step recompiles_eager 110 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes eager --progress 50 --json $OUT/recompiles_eager.json
tail -2 $OUT/recompiles_eager.log
step step_gemms 170 python3 benchmarks/step_gemms.py
cat $OUT/step_gemms.log | cut -c1-200 | grep -v "^ *$\|Warn\|_warn" | tail -40
