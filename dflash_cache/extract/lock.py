"""An exclusive lock on a cache directory that names its holder when refused."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from dflash_cache.errors import DFlashCacheError


class CacheLock:
    """flock on `root/locks/NAME.lock`; released when the process ends, even by SIGKILL."""

    def __init__(self, root: Path, name: str):
        self.path = Path(root) / "locks" / f"{name}.lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None

    def acquire(self) -> "CacheLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise DFlashCacheError(f"{self.path.parent.parent} is being written by {holder}; wait for it or stop it first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
