# Session 22 call 4 (new machine): `train` as a user runs it at the issue's size, eager against --compile, each
# in a new process with new empty caches (train_command.py does that), 512 blocks a batch so that compiled
# pads no blocks (session 18 left this out for device time); the step alone left out (--no-step).
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
step train 400 python3 benchmarks/train_command.py --command "python3 -m dflash_cache_cli.main" --work /tmp/tc \
  --tokens 16384 --max-anchors 512 --anchors-per-batch 512 --steps 10 --modes eager,compiled --no-step --json $OUT/train.json
cp /tmp/tc/*.log $OUT/ 2>/dev/null; grep -v "Warn\|warn" $OUT/train.log | tail -8 | cut -c1-600
