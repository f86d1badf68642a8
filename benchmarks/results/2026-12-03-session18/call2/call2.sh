# Session 18 call 2: train's default sizes at the 27B shape (the anchor cap that fits), eager and compiled;
# a profile of the eager trainer's loop at 16,384 tokens and 64 blocks per sequence.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step train_command 580 python3 benchmarks/train_command.py --command "python3 -m dflash_cache_cli.main" --defaults 8 \
  --steps 0 --work /tmp/tc --profile $OUT/profile --json $OUT/train_command.json
cp /tmp/tc/*.log $OUT/ 2>/dev/null; rm -f $OUT/profile/*.json; grep -h "memory:\|blocks\|step 5/\|step 8/\|rror" /tmp/tc/defaults-*.log | cut -c1-400
tail -40 $OUT/train_command.log | cut -c1-300
