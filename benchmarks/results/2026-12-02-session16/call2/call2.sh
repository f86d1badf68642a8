# Session 16 call 2 (new machine, Triton and Inductor caches in new empty folders): the peer, compiled and
# eager in one process with bf16 working matrices over fp32 masters (train/optim.py CompiledAdamW); then
# the GPU tests.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step drafter 300 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager \
  --json $OUT/drafter.json --peer "$PEER"
grep -h "peer:\|tokens/s\|warm-up step 5\|Error" $OUT/drafter.log
step gputests 240 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py -p no:cacheprovider
tail -15 $OUT/gputests.log
