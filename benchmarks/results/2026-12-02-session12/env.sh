# sourced (session 12; as session 11) on the device from the repo root: wheels (.whl: zstandard; .peerwhl: the peer's), the CLI
# ../shared/peer/speculators_dflash_step.py is carried as .dev/speculators_dflash_step.py (../shared does not travel)
# importable, a step helper that logs each step under $OUT with its rc and seconds
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer .peerwhl/*.whl || exit 1
ln -sfn $PWD/cli /tmp/site/dflash_cache_cli
export PYTHONUNBUFFERED=1 ROOT=$PWD PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
step() {  # step NAME SECONDS CMD...: one log per step under $OUT, its rc and seconds on stdout
  local name=$1 limit=$2; shift 2; local s=$SECONDS
  timeout $limit "$@" > $OUT/$name.log 2>&1; echo "$name rc $? $((SECONDS-s)) s"; }
PEER="env PYTHONPATH=/tmp/peer:/tmp/site LOSS_IMPL=eager SHAPE=27b python3 $ROOT/.dev/speculators_dflash_step.py"
