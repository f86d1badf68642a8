# Session 21 call 2 (new machine or call 1's; Triton and Inductor caches in new empty folders): each head's
# RMSNorm, rotary and flex layout as one Triton pass (drafter/rotary_kernel.py): its GPU tests with the
# drafter's, the pass against Inductor's code for the torch chain, and the drafter beside the peer.
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
D=benchmarks/results/2026-12-03-session21/call2
step gputest 200 python3 -m pytest -m gpu -x -q tests/test_drafter_gpu.py -k "norm_rotate_pack or fused_flex_matches or eager_regions_match or compiled_mode_matches or fused_kernel_equals or without_anchors"
tail -3 $OUT/gputest.log
step rotary 120 python3 $D/rotary.py --rounds 5
grep -v Warn $OUT/rotary.log | tail -9
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
step drafter 330 python3 benchmarks/drafter.py --preset qwen3.6-27b --tokens 16384 --anchors 512 --modes compiled,eager --peer "$PEER" --json $OUT/drafter.json
grep -v "warm-up step\|Warn" $OUT/drafter.log | tail -6
