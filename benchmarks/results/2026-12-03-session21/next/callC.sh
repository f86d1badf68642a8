# For the next session (not run yet): the compiled drafter's cold warm-up and step, main before the norm-rotary
# pass (d570787, in .dev/before: `mkdir -p .dev/before && git archive d570787 dflash_cache | tar -x -C .dev/before`)
# and after it, each in a new process with empty Triton and Inductor caches, twice in alternation.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
for round in 1 2; do
  for code in before after; do
    export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    path=$ROOT; [ $code = before ] && path=$ROOT/.dev/before:$ROOT
    step compiled_${code}_$round 150 env PYTHONPATH=/tmp/site:$path python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled
    grep "compiled warm-up step 1/5\|compiled:" $OUT/compiled_${code}_$round.log
  done
done
