set -uo pipefail
source .dev/setup.sh 3
export TRITON_CACHE_DIR=/tmp/tc3 TORCHINDUCTOR_CACHE_DIR=/tmp/ic3
s=$SECONDS
timeout 560 python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --tokens 8192 --anchors 256 --steps 500 --json $OUT/recompiles.json > $OUT/recompiles.log 2>&1; echo "recompiles rc $? $((SECONDS-s)) s"
tail -20 $OUT/recompiles.log
