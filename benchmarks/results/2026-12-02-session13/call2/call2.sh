# Session 13 call 2: candidate changes to the drafter step (variants.py), each in a process of its own,
# compiled mode then eager; the Triton/Inductor caches are shared, so warm-up figures here are not cold ones
# Outcome: every run hit its 110 s limit with an empty log (nothing measured); call 3 ran imask again
set -uo pipefail; source benchmarks/results/2026-12-02-session11/env.sh
V=benchmarks/results/2026-12-02-session13/call2/variants.py
for v in base imask imask+align kvcat chunk2x; do step $v 110 python3 $V $v compiled; done
for v in base imask; do step eager_$v 110 python3 $V $v eager; done
grep -h "^RESULT\|Error" $OUT/*.log
