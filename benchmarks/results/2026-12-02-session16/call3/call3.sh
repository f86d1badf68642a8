# Session 16 call 3: recompilations over 200 steps of distinct shapes, compiled then eager; train's own
# tests on the GPU (train then runs CompiledAdamW with bf16 working matrices and its checkpoints); the
# optimizer step alone.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
for mode in compiled eager; do
  step recompiles_$mode 185 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 \
    --steps 200 --modes $mode --progress 50 --json $OUT/recompiles_$mode.json
  tail -6 $OUT/recompiles_$mode.log
done
step traintests 80 python3 -m pytest -q -p no:cacheprovider tests/test_train.py tests/test_optim.py -k "resume or compiled or eager_run or bf16 or nonfinite"
tail -5 $OUT/traintests.log


