# Session 14 call C: the LM-head loss's Triton kernel. GPU tests (the kernel against the torch reference, and
# the drafter's), one chunk's loss timed both ways, then the compiled drafter step with the kernel and with
# the torch math, side by side.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
step gputests 200 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py
tail -3 $OUT/gputests.log
step head_loss 90 python3 benchmarks/head_loss.py
cat $OUT/head_loss.log | grep -v "^ \|Warning"
step kernel_compiled 110 python3 benchmarks/drafter.py --modes compiled --json $OUT/kernel_compiled.json
grep -h "tokens/s\|warm-up step 5\|Error" $OUT/kernel_compiled.log | head -5
step torch_compiled 110 python3 benchmarks/results/2026-12-02-session14/callC/reference_loss_step.py --modes compiled --json $OUT/torch_compiled.json
grep -h "tokens/s\|warm-up step 5\|Error" $OUT/torch_compiled.log | head -5
