# Issue 21, call 2 (~9.5 min): the peer, then our eager step (next21: fla kernels) and our compiled step, same GPU, same call
set -uo pipefail; rm -rf /tmp/cold; source .dev/n9/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer $ROOT/.peerwhl/*.whl
step peer 120 env PYTHONPATH=/tmp/peer:/tmp/site LOSS_IMPL=eager SHAPE=27b T=16384 MAX_ANCHORS=512 python3 $ROOT/.dev/speculators_dflash_step.py
tree next21
step drafter_eager 165 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes eager --json $OUT/drafter_eager.json
step drafter_compiled 175 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled --json $OUT/drafter_compiled.json
tail -2 $OUT/peer.log | cut -c1-400; grep -h "tokens/s" $OUT/drafter_*.log
