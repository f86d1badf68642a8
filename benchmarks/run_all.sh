#!/usr/bin/env bash
# Every GPU benchmark in one call, then one table.
#   OUT=bench_out bash benchmarks/run_all.sh [PEER_SCRIPT]
# PEER_SCRIPT: a script of speculators 0.9.0's DFlash training step (reads T and MAX_ANCHORS, prints one JSON
# line); it runs beside our drafter at the same shape, tokens and anchors, and is skipped when not given.
# One GPU: everything in turn. Two or more: first the coupled baseline on GPUs 0 and 1, then the
# extraction benchmarks on GPU 0 while the drafter, speculators and training benchmarks run on GPU 1
# (each ratio is still measured side by side within one process on one GPU, speculators on our drafter's GPU).
# On one GPU the phases run in turn, without the coupled row (it needs two).
set -uo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
peer=${1:-}
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
phase() { echo "== $1 $(date +%T)" | tee -a "$out/phases.txt"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import fla; print('flash-linear-attention', fla.__version__)" 2>/dev/null || echo "flash-linear-attention: not installed"
  echo "host cores: $(nproc)"
} | tee "$out/gpu.txt"

extraction() {
  phase extract-qwen3-8b
  python3 benchmarks/extract.py --shape qwen3-8b --tokens 1200000 --batch-tokens 16384 --json "$out/extract_qwen3_8b.json" > "$out/extract.log" 2>&1
  phase extract-qwen3_5
  python3 benchmarks/extract.py --shape qwen3.6-27b-cut --layers-cut 16 --tokens 120000 --batch-tokens 16384 --json "$out/extract_qwen3_5_cut.json" >> "$out/extract.log" 2>&1
  phase extraction-done
}
drafter_peer_training() {
  phase drafter
  python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --json "$out/drafter.json" > "$out/drafter.log" 2>&1
  if [ -n "$peer" ]; then
    phase peer
    LOSS_IMPL=eager SHAPE=27b T=16384 MAX_ANCHORS=512 python3 "$peer" > "$out/peer.log" 2>&1
    tail -1 "$out/peer.log" > "$out/peer.json"
  fi
  phase train
  python3 benchmarks/train.py --preset qwen3.6-27b --batches 10 --steps 20 --memory-steps 1000 --json "$out/train.json" > "$out/train.log" 2>&1
  phase drafter-peer-training-done
}

if [ "$gpus" -ge 2 ]; then
  phase coupled
  CUDA_VISIBLE_DEVICES=0,1 python3 benchmarks/coupled.py --shape qwen3-8b --drafter qwen3.6-27b --tokens 16384 --warmup 2 --steps 6 --json "$out/coupled.json" > "$out/coupled.log" 2>&1
  ( export CUDA_VISIBLE_DEVICES=0; extraction ) &
  ( export CUDA_VISIBLE_DEVICES=1; drafter_peer_training )
  wait
else
  extraction
  drafter_peer_training
fi
phase end
python3 benchmarks/table.py "$out" | tee "$out/table.md"
