# Session 18 call 1: `dflash-cache train` at the 27B shape as a user runs it (new process, empty compile
# caches), against benchmarks/drafter.py's step on the same batches and anchors; and train's default sizes.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step train_command 570 python3 benchmarks/train_command.py --command "python3 -m dflash_cache_cli.main" --defaults \
  --work /tmp/tc --json $OUT/train_command.json
cp /tmp/tc/*.log $OUT/ 2>/dev/null; grep -h "step 5/\|step 25/\|memory:" /tmp/tc/eager.log /tmp/tc/compiled.log
cat $OUT/train_command.log | tail -8; df -h /tmp | tail -1
