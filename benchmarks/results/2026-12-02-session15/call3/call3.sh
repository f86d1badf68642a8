# Session 15 call 3 (caches pointed at empty folders): both 200-step recompilation audits with packed
# attention and train's compiled AdamW; the optimizers side by side; the head-loss chunk; the one-tile
# limitation's GPU test with packed rows.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step recompiles 300 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 16384 --anchors 512 --steps 200 \
  --modes compiled,eager --progress 50 --json $OUT/recompiles.json
grep -v "^  " $OUT/recompiles.log | tail -6
step optimizer 150 python3 benchmarks/optimizer.py
grep -v Warn $OUT/optimizer.log | grep "ms\|TB/s\|Error" | tail -5
step head_loss 60 python3 benchmarks/head_loss.py
tail -4 $OUT/head_loss.log
step onetile 90 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py -k under_128 -rxX -p no:cacheprovider
tail -4 $OUT/onetile.log
