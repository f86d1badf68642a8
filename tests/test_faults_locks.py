"""Concurrent runs on one folder: one lock per cache whatever the launch mode (plain, spawned,
torchrun of any world size), one per training run folder; a refused run touches nothing."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dflash_cache import DFlashCacheError
from tests.test_extract import LAYERS, cli, run_extract
from tests.tiny import build_target, write_conversations


def test_lock_is_shared_by_one_launch_only(tmp_path):
    """flock is per open file, so one process can play several: the ranks of launch A share the
    lock; launch B and a plain run are refused while any rank of A holds it."""
    from dflash_cache.files.lock import FolderLock

    a0 = FolderLock(tmp_path, "cache").acquire("world 2, master h:1, run x")
    a1 = FolderLock(tmp_path, "cache").acquire("world 2, master h:1, run x")
    for other in ("world 1, master h:2, run y", None):
        with pytest.raises(
            DFlashCacheError, match=rf"^{tmp_path} is being written by torchrun launch \(world 2, master h:1"
        ):
            FolderLock(tmp_path, "cache").acquire(other)
    a0.release()
    with pytest.raises(DFlashCacheError, match="being written by torchrun launch"):
        FolderLock(tmp_path, "cache").acquire(None)
    a1.release()
    plain = FolderLock(tmp_path, "cache").acquire(None)  # the whole launch is gone
    for other in ("world 2, master h:1, run x", None):
        with pytest.raises(DFlashCacheError, match=rf"being written by pid {os.getpid()} on "):
            FolderLock(tmp_path, "cache").acquire(other)
    plain.release()


def test_a_discarded_lock_leaves_no_folder_but_keeps_one_it_found(tmp_path):
    from dflash_cache.files.lock import FolderLock

    lock = FolderLock(tmp_path / "new", "cache").acquire()
    lock.release(discard=True)
    assert not (tmp_path / "new" / "locks").exists()
    FolderLock(tmp_path / "old", "cache").acquire().release()
    lock = FolderLock(tmp_path / "old", "cache").acquire()
    lock.release(discard=True)
    assert (tmp_path / "old" / "locks" / "cache.lock").is_file()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("locks")
    target = build_target(root / "target", "qwen3")
    data = write_conversations(root / "data.jsonl", count=8, seed=1)
    return target, data


def test_a_refused_extract_leaves_nothing_behind(setup, tmp_path):
    """Bad data into a new folder: no folder; another spec into a cache copied without locks/: no locks/."""
    target, data = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [}\n')
    with pytest.raises(DFlashCacheError, match="bad.jsonl:1"):
        run_extract(target, bad, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
    run_extract(target, data, tmp_path / "cache")
    shutil.copytree(tmp_path / "cache", tmp_path / "copy", ignore=shutil.ignore_patterns("locks"))
    with pytest.raises(DFlashCacheError, match="other settings"):
        run_extract(target, data, tmp_path / "copy", topk=2)
    assert not (tmp_path / "copy" / "locks").exists()


def extract_args(target, data, out):
    return [
        "extract",
        "--target",
        target,
        "--data",
        data,
        "--out",
        out,
        "--layers",
        ",".join(map(str, LAYERS)),
        "--token-budget",
        100,
        "--shard-size",
        0.02,
    ]


def torchrun(nproc: int, args, env=None):
    """`dflash-cache ARGS` under a standalone torchrun launch of `nproc` ranks, in its own session."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "dflash_cache_cli.main",
        *map(str, args),
    ]
    return subprocess.Popen(
        command,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of the processes whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append((int(entry), fields[0]))
    return found


def wait_until_frozen(proc: subprocess.Popen, processes: int, timeout: float = 240) -> None:
    """Until `processes` processes (the process itself for 0 children, else its children) are stopped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        states = [s for _, s in _children(proc.pid)] if processes else []
        if not processes:
            with open(f"/proc/{proc.pid}/stat") as f:
                states = [f.read().rsplit(")", 1)[1].split()[0]]
        if states.count("T") == max(processes, 1):
            return
        time.sleep(0.2)
    raise TimeoutError("the first run never reached its stop point")


def stop(proc: subprocess.Popen) -> None:
    for pid, _ in _children(proc.pid):  # torchrun's workers run in sessions of their own
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)


def snapshot(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def assert_refused(proc: subprocess.Popen, out, holder: str) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors and all(line.startswith(f"error: {out} is being written by {holder}") for line in errors), err[-3000:]


FREEZE = {"DFLASH_CACHE_KILL_AT": "extract.forward:1:STOP"}


@pytest.mark.slow
def test_plain_run_then_torchrun_launch_is_refused(setup, tmp_path):
    target, data = setup
    out = tmp_path / "cache"
    first = cli(*extract_args(target, data, out), env=FREEZE, start_new_session=True)
    try:
        wait_until_frozen(first, 0)
        before = snapshot(out)
        assert_refused(torchrun(2, extract_args(target, data, out)), out, f"pid {first.pid} on ")
        assert snapshot(out) == before
    finally:
        stop(first)


@pytest.mark.slow
def test_torchrun_launch_then_another_world_size_or_a_plain_run_is_refused(setup, tmp_path):
    """Both ranks of the first launch get past the lock (each freezes at its first forward); a
    launch of one rank and a plain run are refused while they hold it."""
    target, data = setup
    out = tmp_path / "cache"
    first = torchrun(2, extract_args(target, data, out), env=FREEZE)
    try:
        wait_until_frozen(first, 2)
        before = snapshot(out)
        assert_refused(torchrun(1, extract_args(target, data, out)), out, "torchrun launch (world 2,")
        assert_refused(cli(*extract_args(target, data, out)), out, "torchrun launch (world 2,")
        assert snapshot(out) == before
    finally:
        stop(first)
