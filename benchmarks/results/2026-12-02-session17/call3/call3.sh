# Session 17 call 3 (Triton and Inductor caches in new empty folders): the compiled step with and without
# Inductor's coordinate-descent tuning; then the 200-step recompilation audits of both modes with the
# interval mask function.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step coord 220 python3 benchmarks/results/2026-12-02-session17/call3/variants.py
grep -h "^step" $OUT/coord.log | cut -c1-300; grep -ih "error" $OUT/coord.log | head -3
step recompiles_eager 140 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes eager --progress 50 --json $OUT/recompiles_eager.json
tail -8 $OUT/recompiles_eager.log
step recompiles_compiled 170 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes compiled --progress 50 --json $OUT/recompiles_compiled.json
tail -8 $OUT/recompiles_compiled.log
