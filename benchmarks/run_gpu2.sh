#!/usr/bin/env bash
# Second H200 call of a session: extraction again after a fix, and the training stream benchmark.
set -uo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 benchmarks/extract.py --shape qwen3-8b --tokens 200000 --batch-tokens 16384 --json "$out/extract_qwen3_8b.json" 2>&1 | grep -v Warning | tee "$out/extract.log"
python3 benchmarks/train.py --preset qwen3.6-27b --batches 12 --steps 24 --memory-steps 1000 --json "$out/train.json" 2>&1 | grep -v Warning | tee "$out/train.log"
