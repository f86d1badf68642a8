"""Journals: a line is in a journal whole or not at all, and a torn last line (a crash while it was
appended) is cut back before a rerun appends anything."""

import json
import subprocess
import sys

import pytest

from tests.test_extract import assert_same_cache, cli, extract_args, run_extract
from tests.tiny import build_target, write_conversations

SHARD_BYTES = int(0.02 * (1 << 20))  # extract_args' --shard-size


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("journals")
    target = build_target(root / "target", "qwen3")
    data = write_conversations(root / "data.jsonl", count=10, seed=2)
    reference = root / "reference"
    run_extract(target, data, reference, max_shard_bytes=SHARD_BYTES)
    return target, data, reference


def test_a_torn_last_journal_line_is_cut_before_the_rerun_appends(setup, tmp_path):
    target, data, reference = setup
    out = tmp_path / "cache"
    run_extract(target, data, out, max_shard_bytes=SHARD_BYTES)
    (out / "manifest.json").unlink()
    journal = out / "journal" / "r0.jsonl"
    text = journal.read_bytes()
    last = text.rstrip(b"\n").rfind(b"\n") + 1
    assert b'"shard"' in text[last:]
    journal.write_bytes(text[: last + (len(text) - last) // 2])  # a crash halfway through the last shard's line
    proc = cli(*extract_args(target, data, out))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert f"note: {journal}: cut a torn last line" in err
    assert (out / "manifest.json").is_file()
    lines = journal.read_text().splitlines()
    assert all(isinstance(json.loads(line), dict) for line in lines)  # every line whole
    assert_same_cache(reference, out)


APPEND_UNDER_A_LIMIT = """
import json, os, resource, signal, sys
from dflash_cache.store.journal import append_journal
path, limit = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    append_journal(path, {"shard": {"path": "shards/r0-00001.arrow", "sample_ids": list(range(2000))}})
except OSError as e:
    print(e.strerror)
"""


def test_a_journal_append_that_fails_midway_leaves_no_partial_line(tmp_path):
    """A real short write: a file-size limit just past the journal's end lets part of the line in."""
    journal = tmp_path / "r0.jsonl"
    journal.write_text(json.dumps({"spec": {"codec": "bf16"}}) + "\n")
    before = journal.read_bytes()
    proc = subprocess.run(
        [sys.executable, "-c", APPEND_UNDER_A_LIMIT, str(journal), str(len(before) + 100)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert proc.stdout.strip() == "File too large", proc.stderr
    assert journal.read_bytes() == before
