set -uo pipefail
source .dev/setup.sh 4
export TORCH_LOGS=recompiles TRITON_PRINT_AUTOTUNING=1
run() { local name=$1 limit=$2; shift 2; s=$SECONDS
  TRITON_CACHE_DIR=/tmp/tc_$name TORCHINDUCTOR_CACHE_DIR=/tmp/ic_$name timeout $limit python3 benchmarks/recompiles.py --device cuda --preset qwen3.6-27b --warmup 20 --progress 10 --json $OUT/rc_$name.json "$@" > $OUT/rc_$name.log 2>&1
  echo "$name rc $? $((SECONDS-s)) s"; grep -E "step [0-9]+/|^ +(eager|eager-unfused) +[0-9]" $OUT/rc_$name.log | cut -c1-150; }
run fused8k 135 --tokens 8192 --anchors 256 --steps 100 --modes eager
run unfused8k 135 --tokens 8192 --anchors 256 --steps 100 --modes eager-unfused
run fused4k 70 --tokens 4096 --anchors 128 --steps 60 --modes eager
