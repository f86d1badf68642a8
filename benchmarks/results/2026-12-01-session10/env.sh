# sourced on the device from the repo root: wheels, logs folder, `tree NAME` enters .dev/NAME with it on PYTHONPATH
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 ROOT=$PWD
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader > $OUT/gpu.txt; nproc >> $OUT/gpu.txt
tree() { if [ "$1" = main ]; then cd $ROOT; else cd $ROOT/.dev/$1; fi && ln -sfn $PWD/cli /tmp/site/dflash_cache_cli && export PYTHONPATH=/tmp/site:$PWD; }
step() {  # step NAME SECONDS CMD...: one log per step under $OUT, its rc and seconds on stdout
  local name=$1 limit=$2; shift 2; local s=$SECONDS
  timeout $limit "$@" > $OUT/$name.log 2>&1; echo "$name rc $? $((SECONDS-s)) s"; }
