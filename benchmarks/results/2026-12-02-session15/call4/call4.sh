# Session 15 call 4 (call 3's machine, still warm; its default compile caches, which held nothing of this
# session's: calls 1-3 pointed theirs at fresh folders): the eager 200-step audit, for which call 3 ran out of time.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
step recompiles_eager 150 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 --modes eager --progress 25 --json $OUT/recompiles_eager.json
grep -v "^  " $OUT/recompiles_eager.log | tail -6; tail -3 $OUT/recompiles_eager.log
