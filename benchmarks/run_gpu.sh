#!/usr/bin/env bash
# Every GPU benchmark in one go, on one H200; writes logs and JSON under ${OUT:-bench_out}.
#   bash benchmarks/run_gpu.sh [PEER_SCRIPT]
# PEER_SCRIPT: the speculators DFlash step script (../shared/peer/speculators_dflash_step.py), run
# side by side with our drafter at the same shape, tokens and anchors; skipped when absent.
set -uo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
peer=${1:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
python3 benchmarks/extract.py --shape qwen3-8b --tokens 300000 --batch-tokens 16384 --json "$out/extract_qwen3_8b.json" 2>&1 | grep -v Warning | tee "$out/extract.log"
python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --json "$out/drafter.json" 2>&1 | tee "$out/drafter.log"
if [ -n "$peer" ]; then
  LOSS_IMPL=eager SHAPE=27b T=16384 MAX_ANCHORS=512 python3 "$peer" 2>&1 | tail -3 | tee "$out/peer.log"
fi
python3 -c "import fla; print('flash-linear-attention', fla.__version__)" 2>&1 | tee -a "$out/gpu.txt"
python3 benchmarks/extract.py --shape qwen3.6-27b-cut --layers-cut 16 --tokens 120000 --batch-tokens 16384 --json "$out/extract_qwen3_5_cut.json" 2>&1 | grep -v Warning | tee -a "$out/extract.log"
