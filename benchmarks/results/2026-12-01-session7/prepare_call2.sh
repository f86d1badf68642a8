#!/usr/bin/env bash
# Run here: the warm-up variants for call C1 (main and issue-15-dryrun, each with Triton's timing cut to 5+25 ms and to 1+10 ms)
set -euo pipefail
cd /work/main
copy() { rm -rf .dev/$1 && mkdir -p .dev/$1 && (cd $2 && git ls-files -co --exclude-standard | grep -v -e "^benchmarks/results" -e "^examples/" | tar cf - -T -) | tar xf - -C .dev/$1; }
short() { sed -i 's/^BENCH_WARMUP_MS, BENCH_REP_MS = 5, 25$/BENCH_WARMUP_MS, BENCH_REP_MS = 1, 10/' .dev/$1/dflash_cache/extract/warmup.py; grep -q "= 1, 10" .dev/$1/dflash_cache/extract/warmup.py; }
copy main_short /work/main; short main_short
copy dry /work/wt-15c
copy dry_short /work/wt-15c; short dry_short
du -sh .dev .whl .peerwhl
