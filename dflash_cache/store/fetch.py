"""Whole shards of a remote cache, fetched into a local folder whose size is bounded.

Each shard is downloaded once, checked against the manifest's size and sha256, and then read from
the local disk (memory-mapped) like a local cache. Past `max_bytes`, the least recently opened
shards are deleted. The bound is per process; processes may share a folder (a file one of them
fetched is reused by the others), and files left by an earlier run are reused and counted.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.paths import check_shard_path, inside
from dflash_cache.store.reader import ShardReader
from dflash_cache.store.remote import RemoteDir
from dflash_cache.store.shard import SHARD_DIR, ShardRecord, file_sha256


class ShardFetcher:
    def __init__(
        self,
        remote: RemoteDir,
        folder: str | Path,
        max_bytes: int | None = None,
        on_evict: Callable[[str], None] = lambda path: None,
    ):
        self.remote = remote
        self.root = Path(folder) / hashlib.sha256(remote.url.encode()).hexdigest()[:16]  # one folder per cache
        (self.root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self._lock = threading.Lock()
        self._gates: dict[str, threading.Lock] = {}
        self._pending = 0  # bytes being downloaded
        old = sorted((p for p in (self.root / SHARD_DIR).glob("*.arrow")), key=lambda p: p.stat().st_mtime)
        self._held: OrderedDict[str, int] = OrderedDict((f"{SHARD_DIR}/{p.name}", p.stat().st_size) for p in old)
        self.downloads = 0
        self._checked: set[str] = set()  # shards whose local file this process has hashed

    def open(self, shard: ShardRecord) -> ShardReader:
        """A reader of the local copy of `shard`, downloading it first when needed."""
        if self.max_bytes is not None and shard.bytes > self.max_bytes:
            raise DFlashCacheError(
                f"shard {shard.path} has {shard.bytes} bytes, more than the local cache may hold "
                f"({self.max_bytes}); raise the local cache size"
            )
        try:
            local = inside(self.root, self.root / check_shard_path(shard.path))
        except ValueError as e:  # the manifest's reader checks it first; this folder is written and deleted in
            raise DFlashCacheError(f"{self.remote.url}: {e}") from None
        with self._lock:
            gate = self._gates.setdefault(shard.path, threading.Lock())
        with gate:  # one download per shard, whatever the number of threads asking for it
            with self._lock:
                if shard.path in self._held and local.is_file():
                    self._held.move_to_end(shard.path)
                    return ShardReader(local)
                self._held.pop(shard.path, None)
                self._make_room(shard.bytes)
                self._pending += shard.bytes
            try:
                if not (local.is_file() and local.stat().st_size == shard.bytes):  # another process fetched it
                    self._download(shard, local)
            finally:
                with self._lock:
                    self._pending -= shard.bytes
            with self._lock:  # tracked and opened together, so no other thread evicts it in between
                self._held[shard.path] = shard.bytes
                return ShardReader(local)

    def _download(self, shard: ShardRecord, local: Path) -> None:
        self.remote.download(shard.path, local)
        self.downloads += 1
        if local.stat().st_size != shard.bytes or file_sha256(local) != shard.sha256:
            local.unlink(missing_ok=True)
            raise DFlashCacheError(f"{self.remote.url_of(shard.path)}: size or sha256 does not match the manifest")
        self._checked.add(shard.path)

    def checked(self, shard_path: str) -> bool:
        """Whether this process downloaded the shard and found the manifest's sha256 (a copy left by an
        earlier run, or fetched by another process, was not checked here)."""
        return shard_path in self._checked

    def _make_room(self, incoming: int) -> None:
        """Delete least recently opened shards until `incoming` more bytes fit (called under the lock)."""
        if self.max_bytes is None:
            return
        while self._held and sum(self._held.values()) + self._pending + incoming > self.max_bytes:
            path, _ = self._held.popitem(last=False)
            (self.root / path).unlink(missing_ok=True)  # a reader still mapping it keeps its pages
            self.on_evict(path)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(self._held.values())
