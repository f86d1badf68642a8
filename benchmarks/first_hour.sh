#!/bin/bash
# The first hour: every command of the README's "On a CPU, with a small target" with its
# defaults, timed one by one, the load average before each. Usage: benchmarks/first_hour.sh WORK_DIR
# (emptied first); runs the dflash-cache of the Python in $PYTHON (default: python).
set -u
W=$1; PY=${PYTHON:-python}; ASSETS=$(cd "$(dirname "$0")/../examples/assets" && pwd)
rm -rf "$W"; mkdir -p "$W"; cd "$W" || exit 1
export DFLASH_CACHE_TOKENIZED_DIR=$W/tokenized  # a fresh machine: nothing tokenized yet
# 300 of the bundled conversations, every other one as a ShareGPT record, ids of both kinds
$PY - "$ASSETS/data/train.jsonl" conv.jsonl <<'PY'
import json, sys
roles = {"user": "human", "assistant": "gpt", "system": "system"}
with open(sys.argv[1]) as source, open(sys.argv[2], "w") as out:
    for i, line in zip(range(300), source):
        messages = json.loads(line)["messages"]
        record = ({"id": f"oa-{i}", "messages": messages} if i % 2 == 0 else
                  {"id": i, "conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in messages]})
        out.write(json.dumps(record) + "\n")
PY
step() {
  name=$1; shift
  echo "== dflash-cache $*"; echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  start=$(date +%s.%N); $PY -m dflash_cache_cli.main "$@" > "$name.log" 2>&1; rc=$?; end=$(date +%s.%N)
  echo "rc=$rc wall=$(echo "$end - $start" | bc) s"; tail -3 "$name.log"
}
step extract extract --target "$ASSETS/target" --data conv.jsonl --out C
step train train --cache C --out R --steps 200
step export export R --out E
step eval_cache eval --drafter R --cache C
step eval_target eval --drafter E --target "$ASSETS/target" --data "$ASSETS/data/heldout.jsonl"
