# Session 22 call 3 (new machine; caches in new empty folders): the eager drafter's recompilation audit over
# 200 steps of distinct shapes on main's code (session 21 ran it on 86a2f96, before the pass's last edits).
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
git log --oneline -1 2>/dev/null
step recompiles_eager 330 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes eager --progress 50 --json $OUT/recompiles_eager.json
tail -5 $OUT/recompiles_eager.log
