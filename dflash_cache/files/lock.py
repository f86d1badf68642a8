"""One lock per folder (a cache, a training run) that names its holder when refused.

`FolderLock(root, name).acquire(launch)` takes flock on `root/locks/NAME.lock`, released when the
process ends, even by SIGKILL. A process of its own (`launch` None: a plain or spawning run) takes
it exclusively. The ranks of one torchrun launch share it: each passes the same `launch` key (see
`launch_key`), the first takes it exclusively, writes the key into the file and turns it into a
shared lock; the others find the same key and take it shared too. A process of another launch, or
a plain run, is refused while any of them holds it.

Those steps are made atomic by a second lock, `locks/NAME.guard`, held only while they run.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from dflash_cache.errors import DFlashCacheError

LOCK_DIR = "locks"
GUARD_WAIT_S = 30.0  # the guard is held for microseconds; a process frozen while holding it is stuck


def launch_key() -> str | None:
    """What the ranks of one torchrun launch share and two concurrent launches never do (their
    rendezvous address and port, run id and world size); None outside torchrun."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return (
        f"world {env['WORLD_SIZE']}, master {env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}, "
        f"run {env.get('TORCHELASTIC_RUN_ID', '?')}"
    )


NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def not_writable(root: Path, e: OSError) -> DFlashCacheError:
    return DFlashCacheError(f"{root} is not writable ({e.strerror}); make it writable or choose another folder")


def make_folder(root: Path) -> None:
    """mkdir -p, with a one-line error for a folder that cannot be made."""
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in NOT_WRITABLE:
            raise not_writable(root, e) from None
        raise DFlashCacheError(f"cannot create {root} ({e.strerror})") from None


class FolderLock:
    def __init__(self, root: Path, name: str, what: str = "being written"):
        self.root = Path(root)
        self.path = self.root / LOCK_DIR / f"{name}.lock"
        self.guard_path = self.root / LOCK_DIR / f"{name}.guard"
        self.what = what
        self._fd: int | None = None
        self.created = False  # whether acquire made locks/ (then `release(discard=True)` removes it)

    def acquire(self, launch: str | None = None) -> FolderLock:
        """Raises DFlashCacheError naming the holder when another process or launch holds the lock."""
        me = f"pid {os.getpid()} on {socket.gethostname()}"
        try:
            self.created = not self.path.parent.exists()
            guard = self._open_guard()
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    self._take(fd, launch, me)
                except BaseException:
                    os.close(fd)
                    raise
            finally:
                os.close(guard)  # releases the guard
        except OSError as e:
            if e.errno in NOT_WRITABLE:
                raise not_writable(self.root, e) from None
            raise
        self._fd = fd
        return self

    def _open_guard(self) -> int:
        """The guard file, flocked; reopened when it was replaced while this process waited for it."""
        deadline = time.monotonic() + GUARD_WAIT_S
        while True:
            self.guard_path.parent.mkdir(parents=True, exist_ok=True)  # again: a discarding run may remove it
            fd = os.open(self.guard_path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _flock_by(fd, deadline):
                os.close(fd)
                raise DFlashCacheError(
                    f"{self.guard_path} stays locked by a process that does not release it; stop that process first"
                )
            try:
                if os.fstat(fd).st_ino == os.stat(self.guard_path).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def _take(self, fd: int, launch: str | None, me: str) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 300, 0).decode(errors="replace").strip() or "another process"
            if launch is not None and holder.startswith(f"torchrun launch ({launch})"):
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a rank of the same launch: join it
                    return
                except BlockingIOError:
                    pass
            raise self.refusal(holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (me if launch is None else f"torchrun launch ({launch}): {me} and its other ranks").encode(), 0)
        os.fsync(fd)
        if launch is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)  # under the guard: nobody can slip in between

    def refusal(self, holder: str) -> DFlashCacheError:
        return DFlashCacheError(f"{self.root} is {self.what} by {holder}; wait for it or stop it first")

    def check_free(self) -> None:
        """Raises as `acquire` would while another process holds the lock, taking nothing: for the
        checks a command makes before it takes it, whose own advice would be wrong meanwhile."""
        if holder := self.holder():
            raise self.refusal(holder)

    def holder(self) -> str | None:
        """Who holds the lock now (as a refusal would name them), or None; for readers, which write
        nothing (a missing lock file is no holder). Probes under the guard, as `acquire` does, so a
        writer arriving meanwhile waits for the probe to end rather than being refused by it."""
        try:
            guard = os.open(self.guard_path, os.O_RDONLY | os.O_NOFOLLOW)  # a reader follows no link out
        except OSError:
            return None
        try:
            if not _flock_by(guard, time.monotonic() + GUARD_WAIT_S):
                return None
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # exclusive: the ranks of a launch hold it shared
                return None  # closing the file releases the probe
            except BlockingIOError:
                return os.pread(fd, 300, 0).decode(errors="replace").strip() or "another process"
            finally:
                os.close(fd)
        except OSError:
            return None
        finally:
            os.close(guard)

    def release(self, discard: bool = False) -> None:
        """`discard`: a run that wrote nothing else leaves nothing behind: when `acquire` made locks/
        and no other process holds the lock, the lock files and locks/ are removed too."""
        if self._fd is None:
            return
        if discard and self.created:
            guard = self._open_guard()
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                for path in (self.path, self.guard_path):
                    path.unlink(missing_ok=True)
                try:
                    self.path.parent.rmdir()
                except OSError:
                    pass  # not empty: another lock lives there
            except BlockingIOError:
                pass  # other ranks of this launch still hold it
            finally:
                os.close(guard)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _flock_by(fd: int, deadline: float) -> bool:
    """An exclusive flock on `fd`, retried until `deadline` (time.monotonic()); False if it passed."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
