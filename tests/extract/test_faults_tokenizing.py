"""Faults of the tokenized data as extraction meets them: an extraction killed while it tokenizes
(real processes, real signals), whose tokenizer processes end with it and hold no lock, the reruns
proceeding and cleaning what it left; a kept file changed since it was written."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_cache.extract.pipeline import ExtractEvents, ExtractOptions, extract
from tests.support.extract import LAYERS, assert_same_cache, extract_args, run_extract
from tests.support.tiny import build_target, write_conversations
from tests.support.tokenized import rewrite_ids


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizing_faults")
    # More than one chunk of records (dataset.CHUNK_RECORDS): the pool is busy when the first is written.
    return build_target(root / "target", "qwen3"), write_conversations(root / "data.jsonl", count=300, seed=3)


def descendants(pid: int) -> set[int]:
    """Every living process below `pid`, from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def running(pid: int) -> bool:
    return state(pid) not in (None, "Z")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_an_extraction_killed_while_tokenizing_leaves_no_process_no_lock_and_no_temporary_file(setup, tmp_path, sig):
    target, data = setup
    tokenized = tmp_path / "tokenized"

    def args(out):
        return [*extract_args(target, data, out), "--tokenized-dir", tokenized, "--tokenize-workers", 2]

    with open(tmp_path / "first.err", "w") as err:  # a file: a pipe stays open while any survivor holds it
        first = subprocess.Popen(
            [sys.executable, "-m", "dflash_cache_cli.main", *map(str, args(tmp_path / "cache"))],
            env={**os.environ, "DFLASH_CACHE_KILL_AT": "tokenize.chunk:1:STOP"},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    pool: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while state(first.pid) != "T":  # a chunk written, the pool's processes tokenizing the next ones
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.err").read_text()[-2000:]
            time.sleep(0.1)
        pool = descendants(first.pid)
        assert pool, "the extraction tokenizes in a process pool"
        first.send_signal(sig)
        first.send_signal(signal.SIGCONT)  # a stopped process takes SIGTERM when it goes on
        assert first.wait(timeout=60) in (-sig, 128 + sig)  # killed, or ended by the CLI's own handler
        deadline = time.monotonic() + 30
        while {p for p in pool if running(p)} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not {p for p in pool if running(p)}, "processes of the killed extraction outlived it"
        assert list(tokenized.glob("*.arrow.tmp*")), "the killed run left its unfinished tokenized file"
        # Another --out on the same tokenized data (it waited forever), then the killed run's own --out
        # (refused, naming the dead pid).
        for out in (tmp_path / "other", tmp_path / "cache"):
            rerun = subprocess.run(
                [sys.executable, "-m", "dflash_cache_cli.main", *map(str, args(out))],
                capture_output=True,
                text=True,
                timeout=150,
                check=False,
            )
            assert rerun.returncode == 0, rerun.stderr[-2000:]
        assert not [p.name for p in tokenized.iterdir() if ".tmp" in p.name]
    finally:
        first.kill()
        first.wait()
        for pid in pool:  # a failing run leaves no orphan behind
            if running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_token_ids_changed_in_the_kept_file_are_found_by_the_next_extraction(qwen3_target_dir, conversations, tmp_path):
    """The ids rewritten inside KEY.arrow (schema and row count kept) and KEY.index.npy deleted: an
    extraction into a new --out says so, tokenizes again and makes the same cache as the first."""
    tokenized = tmp_path / "tokenized"
    run_extract(qwen3_target_dir, conversations, tmp_path / "first", tokenized_dir=tokenized, tokenize_workers=0)
    [entry] = tokenized.glob("*.arrow")
    rewrite_ids(entry, lambda sid, ids: ids[::-1].copy())
    entry.with_suffix(".index.npy").unlink()
    notes = []

    class Notes(ExtractEvents):
        def note(self, line: str) -> None:
            notes.append(line)

    extract(
        ExtractOptions(
            target=qwen3_target_dir,
            data=[conversations],
            out=tmp_path / "second",
            layers=LAYERS,
            token_budget=300,
            tokenized_dir=tokenized,
            tokenize_workers=0,
        ),
        Notes(),
    )
    assert_same_cache(tmp_path / "first", tmp_path / "second")
    assert notes[0] == f"{entry} is not the file that was written (its checksum differs); tokenizing the data again"
    assert [note.startswith("the cache will take about ") for note in notes[1:]] == [True]  # the disk it needs
