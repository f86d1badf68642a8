# sourced from the repo root on the device: wheels, the package on PYTHONPATH, logs under $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
cd .dev/wt && ln -sfn $PWD/cli /tmp/site/dflash_cache_cli
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm --format=csv,noheader; nproc; date; } > $OUT/gpu_$1.txt
