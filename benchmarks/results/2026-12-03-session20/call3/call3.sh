# Session 20 call 3 (new machine, Triton and Inductor caches in new empty folders): the eager drafter's
# recompilation audit over the full 200 steps of distinct shapes, on main (session 19's was cut at step 150).
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step recompiles_eager 215 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes eager --progress 50 --json $OUT/recompiles_eager.json
tail -4 $OUT/recompiles_eager.log
