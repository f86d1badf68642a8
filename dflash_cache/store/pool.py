"""A bounded pool of open shard readers: at most `size` shards open at once, least recently used
closed first.

Each open local shard holds a file descriptor and a memory map; a cache of 100,000+ shards read
with one reader per shard kept open runs past `ulimit -n` and `vm.max_map_count`. With the pool the
count is constant in the number of shards. A reader is never closed while a thread reads it: a
thread that needs a new shard while every pooled reader is in use waits for one to be released.
Rows already read stay valid after their shard is closed (Arrow buffers keep their mapping alive
until the last one is released).
"""

from __future__ import annotations

import resource
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.reader import ShardReader

# Well under the usual 1024 descriptors (several ranks' pools, TensorBoard, sockets share a node's
# limits per process, not per node) and vm.max_map_count (65,530).
DEFAULT_MAX_OPEN_SHARDS = 128
# Shards may take this share of the process's descriptor limit; the rest is for its other files, sockets and pipes.
LIMIT_SHARE = 4


def default_pool_size() -> tuple[int, str | None]:
    """The pool size when none is given: DEFAULT_MAX_OPEN_SHARDS, or a quarter of the process's soft
    RLIMIT_NOFILE where that is lower; with a note saying so then."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft // LIMIT_SHARE >= DEFAULT_MAX_OPEN_SHARDS:
        return DEFAULT_MAX_OPEN_SHARDS, None
    size = max(1, soft // LIMIT_SHARE)
    return size, (
        f"at most {size} shard files open at once (not {DEFAULT_MAX_OPEN_SHARDS}): a quarter of this "
        f"process's limit of {soft} file descriptors; raise `ulimit -n` or set --max-open-shards"
    )


@dataclass
class _Entry:
    reader: ShardReader
    users: int = 0
    retired: bool = False  # dropped by `forget` while in use: closed when the last user releases it


class ShardPool:
    def __init__(self, size: int | None = None):
        """`size`: the most readers open at once; None sizes it from the descriptor limit (default_pool_size)."""
        if size is None:
            size = default_pool_size()[0]
        if size < 1:
            raise DFlashCacheError(f"--max-open-shards must be at least 1 (got {size})")
        self.size = size
        self._open: OrderedDict[Hashable, _Entry] = OrderedDict()  # least recently used first
        self._opening: set[Hashable] = set()
        self._retired: list[_Entry] = []
        self._cond = threading.Condition()
        self.opens = 0  # shards opened so far (a shard evicted and needed again counts again)

    def _held(self) -> int:
        return len(self._open) + len(self._opening) + len(self._retired)

    @contextmanager
    def reader(self, key: Hashable, open_shard: Callable[[], ShardReader]) -> Iterator[ShardReader]:
        """The reader of shard `key`, opened by `open_shard()` unless pooled; held open inside the block."""
        entry = self._acquire(key, open_shard)
        try:
            yield entry.reader
        finally:
            with self._cond:
                entry.users -= 1
                if entry.retired and entry.users == 0:
                    self._retired.remove(entry)
                    entry.reader.close()
                self._cond.notify_all()

    def _acquire(self, key: Hashable, open_shard: Callable[[], ShardReader]) -> _Entry:
        with self._cond:
            while True:
                entry = self._open.get(key)
                if entry is not None:
                    entry.users += 1
                    self._open.move_to_end(key)
                    return entry
                if key in self._opening:  # another thread is opening it
                    self._cond.wait()
                    continue
                if self._held() < self.size:
                    break
                idle = next((k for k, e in self._open.items() if e.users == 0), None)
                if idle is not None:
                    self._open.pop(idle).reader.close()  # under the lock, so the bound holds at every moment
                    break
                self._cond.wait()  # every pooled reader is in use
            self._opening.add(key)
        try:
            reader = open_shard()
        except BaseException:
            with self._cond:
                self._opening.discard(key)
                self._cond.notify_all()
            raise
        with self._cond:
            self._opening.discard(key)
            entry = self._open[key] = _Entry(reader, users=1)
            self.opens += 1
            self._cond.notify_all()
        return entry

    def forget(self, match: Callable[[Hashable], bool]) -> None:
        """Drop the readers whose key matches (their file is gone); one in use closes when released."""
        with self._cond:
            for key in [k for k in self._open if match(k)]:
                entry = self._open.pop(key)
                if entry.users == 0:
                    entry.reader.close()
                else:
                    entry.retired = True
                    self._retired.append(entry)
            self._cond.notify_all()

    def open_count(self) -> int:
        with self._cond:
            return self._held()

    def close(self) -> None:
        with self._cond:
            for entry in [*self._open.values(), *self._retired]:
                entry.reader.close()
            self._open.clear()
            self._retired.clear()
