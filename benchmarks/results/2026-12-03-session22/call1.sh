# Session 22 call 1 (new machine; Triton and Inductor caches in new empty folders): the command,
# both modes beside the peer in one process, with nvidia-smi sampling clocks, power and the clock's
# reasons every 100 ms beside it and each output line stamped with the time it came (to find the timed steps).
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active \
  --format=csv -lms 100 > $OUT/clocks.csv 2>&1 &
SMI=$!
s=$SECONDS
timeout 540 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager \
  --peer "$PEER" --json $OUT/drafter.json 2>&1 | while IFS= read -r line; do echo "$(date +%Y/%m/%d\ %H:%M:%S.%3N) $line"; done > $OUT/drafter.log
echo "drafter rc ${PIPESTATUS[0]} $((SECONDS-s)) s"
kill $SMI
grep -v "Warn\|warn" $OUT/drafter.log | tail -12
