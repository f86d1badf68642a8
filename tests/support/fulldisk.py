"""A disk that fills up at a chosen moment: a small tmpfs mounted in a user namespace (no privileges
needed), a command frozen at a fault point (`DFLASH_CACHE_KILL_AT=NAME:N:STOP`), the disk filled to
its last byte, the command let go on; then the disk is emptied and a second command run on it."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.cli import shell_command


def can_mount_tmpfs() -> bool:
    try:
        return (
            subprocess.run(
                ["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                capture_output=True,
                timeout=30,
                check=False,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class Outcome:
    returncode: int
    stderr: str


def fill_at(point: str, first: list, then: list, disk: Path, logs: Path, size: str = "16m") -> tuple[Outcome, Outcome]:
    """Runs `dflash-cache FIRST` with the disk filled once it reaches `point`, then `dflash-cache THEN`
    on the emptied disk. Returns both outcomes; copies of the disk as each left it are in
    `logs/after-first` and `logs/after-then`."""

    disk.mkdir()
    script = f"""
        mount -t tmpfs -o size={size} tmpfs '{disk}' || exit 99
        DFLASH_CACHE_KILL_AT='{point}:STOP' {shell_command(*first)} 2> '{logs}/first.err' &
        pid=$!
        until [ "$(cut -d')' -f2 /proc/$pid/stat | cut -d' ' -f2)" = T ]; do kill -0 $pid || break; sleep 0.1; done
        dd if=/dev/zero of='{disk}/fill' bs=64k 2> /dev/null
        kill -CONT $pid; wait $pid; echo $? > '{logs}/first.rc'
        rm '{disk}/fill'
        cp -r '{disk}' '{logs}/after-first'
        {shell_command(*then)} 2> '{logs}/then.err'; echo $? > '{logs}/then.rc'
        cp -r '{disk}' '{logs}/after-then'
    """
    subprocess.run(["unshare", "-Urm", "sh", "-c", script], timeout=600, check=True)
    outcomes = [
        Outcome(int((logs / f"{name}.rc").read_text()), (logs / f"{name}.err").read_text())
        for name in ("first", "then")
    ]
    return outcomes[0], outcomes[1]
