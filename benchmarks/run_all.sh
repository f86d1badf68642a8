#!/usr/bin/env bash
# Every GPU benchmark in one call, then one table: on one H200 about 7 minutes; with 2+ GPUs visible,
# also the coupled baseline against training from a cache (about 2 more minutes).
#   OUT=bench_out bash benchmarks/run_all.sh [PEER_SCRIPT]
# PEER_SCRIPT: ../shared/peer/speculators_dflash_step.py (needs the wheels of ../shared/peer/wheels.txt);
# it runs beside our drafter at the same shape, tokens and anchors, and is skipped when not given.
set -uo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
peer=${1:-}
phase() { echo "== $1 $(date +%T)" | tee -a "$out/phases.txt"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import fla; print('flash-linear-attention', fla.__version__)" 2>/dev/null || echo "flash-linear-attention: not installed"
} | tee "$out/gpu.txt"
phase extract-qwen3-8b
python3 benchmarks/extract.py --shape qwen3-8b --tokens 300000 --batch-tokens 16384 --json "$out/extract_qwen3_8b.json" 2>&1 | tee "$out/extract.log"
phase extract-qwen3_5
python3 benchmarks/extract.py --shape qwen3.6-27b-cut --layers-cut 8 --tokens 80000 --batch-tokens 16384 --json "$out/extract_qwen3_5_cut.json" 2>&1 | tee -a "$out/extract.log"
phase drafter
python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --json "$out/drafter.json" 2>&1 | tee "$out/drafter.log"
if [ -n "$peer" ]; then
  phase peer
  LOSS_IMPL=eager SHAPE=27b T=16384 MAX_ANCHORS=512 python3 "$peer" 2>&1 | tail -1 | tee "$out/peer.json"
fi
phase train
python3 benchmarks/train.py --preset qwen3.6-27b --batches 12 --steps 24 --memory-steps 1000 --json "$out/train.json" 2>&1 | tee "$out/train.log"
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  phase coupled
  python3 benchmarks/coupled.py --shape qwen3-8b --drafter qwen3.6-27b --tokens 16384 --warmup 3 --steps 12 --json "$out/coupled.json" 2>&1 | tee "$out/coupled.log"
fi
phase end
python3 benchmarks/table.py "$out" | tee "$out/table.md"
