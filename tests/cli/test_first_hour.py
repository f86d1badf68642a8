"""The first hour of a new user on a CPU: the bundled 4-layer target and their own mixed conversations
(OpenAI `messages` and ShareGPT records), every command with no options beyond the essential ones:

    extract --target T --data D --out C;  train --cache C --out R --steps N;  export R --out E;
    eval --drafter R --cache C;  eval --drafter E --target T --data HELD_OUT
"""

import json
import os
import stat
import warnings

import pytest

from dflash_cache import open_cache
from dflash_cache.demo import ASSETS
from tests.support.cli import invoke

pytestmark = pytest.mark.slow

# 10 records: sample 3 is the one of them a run holds out by default (1%, by a hash of the sample id).
RECORDS = 10


def mixed_conversations(path, count: int):
    """The bundled conversations, every other one as a ShareGPT record, with ids of both kinds."""
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    with open(ASSETS / "data" / "train.jsonl") as source, open(path, "w") as out:
        for i, line in zip(range(count), source):
            messages = json.loads(line)["messages"]
            if i % 2 == 0:
                record = {"id": f"oa-{i}", "messages": messages}
            else:
                record = {
                    "id": i,
                    "conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in messages],
                }
            out.write(json.dumps(record) + "\n")
    return path


def run(*args) -> str:
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return result.output


def test_the_whole_job_with_default_options(tmp_path):
    target, data = ASSETS / "target", mixed_conversations(tmp_path / "conversations.jsonl", RECORDS)
    cache, run_dir, export = tmp_path / "cache", tmp_path / "run", tmp_path / "export"
    old_umask = os.umask(0o022)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            extracted = run("extract", "--target", target, "--data", data, "--out", cache)
            trained = run("train", "--cache", cache, "--out", run_dir, "--steps", 5)
            exported = run("export", run_dir, "--out", export)
            offline = run("eval", "--drafter", run_dir, "--cache", cache)
            live = run(
                "eval",
                "--drafter",
                export,
                "--target",
                target,
                "--data",
                ASSETS / "data" / "heldout.jsonl",
                "--num-prompts",
                1,
                "--max-new-tokens",
                8,
            )
    finally:
        os.umask(old_umask)

    assert f"done: {RECORDS} samples" in extracted
    # Every layer of a 4-layer target, and a drafter of the target's own shape.
    assert json.loads((cache / "manifest.json").read_text())["spec"]["layer_ids"] == [0, 1, 2, 3]
    # The records' own ids, of both kinds, are keys of the cache beside the sample ids.
    opened = open_cache(cache)
    assert opened["oa-0"].sample_id == 0 and opened["3"].sample_id == 3 and opened[4].record_id == "oa-4"
    assert (
        "drafter (the target's shape): 5 layers, hidden 256, FFN 768, 4 heads / 2 KV heads of 64, block 16, "
        "mask token 3, reading target layers [0, 1, 2, 3]: 4.20M parameters"
    ) in trained
    assert "9 to train on, 1 held out" in trained and "steps of 2,048 tokens per batch" in trained
    assert "memory: about " in trained and " of RAM available" in trained
    assert "step 5/5 | loss" in trained and "0.0k tok/s" not in trained and "eval @ step 5" in trained
    assert f"-> {export}" in exported
    # Offline tau over the run's own held-out samples, as the run evaluated them at its last step.
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert "samples: the held-out split of" in offline and "1 samples" in offline
    assert f"tau {logged['eval_tau']:.3f}, loss {logged['eval_loss']:.4f}" in offline
    assert "every output equal to the target's greedy output" in live and "offline tau" in live
    for path in (export / "model.safetensors", cache / "target" / "head.safetensors"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    ours = [
        w
        for w in caught
        if "past_key_values" in str(w.message)
        or "lr_scheduler" in str(w.message)
        or str(w.filename).startswith(str(ASSETS.parent.parent / "dflash_cache"))
    ]
    assert not ours, [str(w.message) for w in ours]
