#!/usr/bin/env bash
# Run here: copies the branch trees the calls need into .dev/<name>; carry [".whl", ".dev", ".peerwhl"]
set -euo pipefail
cd /work/main
copy() { rm -rf .dev/$1 && mkdir -p .dev/$1 && (cd $2 && git ls-files -co --exclude-standard | grep -v -e "^benchmarks/results" -e "^examples/" | tar cf - -T -) | tar xf - -C .dev/$1; }
rm -rf .dev/dryrun .dev/slices
copy procs /work/wt-15d      # branch issue-15-procs
copy fused /work/wt-21       # branch issue-21-fused
cp /work/shared/peer/speculators_dflash_step.py .dev/
du -sh .dev .whl .peerwhl
