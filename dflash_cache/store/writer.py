"""`ShardWriter`: writes a shard under a temporary name, fsyncs it, renames it into place and only
then records it in the rank's journal. A shard that is not in a journal does not exist as far as
every reader is concerned; a resumed run deletes such leftovers (store/resume.py).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from dflash_cache.errors import DFlashCacheError
from dflash_cache.files import faults
from dflash_cache.store.journal import JOURNAL_DIR, append_journal
from dflash_cache.store.schema import ROW_SCHEMA, Row
from dflash_cache.store.shard import SHARD_DIR, TMP_SUFFIX, ShardRecord, fsync_dir, shard_name


class _Sealer:
    """Hashes a shard file while it is being written and starts its write-back to disk as it goes
    (on a background thread), so that closing it leaves only the last bytes to hash and sync. The
    file is only ever appended to, so bytes once written never change under the hash."""

    SYNC_EVERY = 64 << 20

    def __init__(self, path: Path):
        self.path = path
        self.written = 0
        self.closed = False
        self.cond = threading.Condition()

    def grew(self, size: int, closed: bool = False) -> None:
        with self.cond:
            self.written, self.closed = size, closed
            self.cond.notify()

    def start(self) -> Future:
        """Run on a daemon thread (a shard left open must not keep the process from exiting)."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(self.run())
            except BaseException as e:  # noqa: BLE001 - handed to whoever journals the shard
                future.set_exception(e)

        threading.Thread(target=run, daemon=True, name=f"seal-{self.path.name}").start()
        return future

    def run(self) -> str:
        """Returns the sha256 of the whole file once it is closed and durable."""
        sha = hashlib.sha256()
        done = synced = 0
        with open(self.path, "rb", buffering=0) as f:
            while True:
                with self.cond:
                    while self.written == done and not self.closed:
                        self.cond.wait()
                    target, closed = self.written, self.closed
                while done < target:
                    block = f.read(min(8 << 20, target - done))
                    if not block:
                        raise DFlashCacheError(f"{self.path}: ends at {done} bytes, {target} were written")
                    sha.update(block)
                    done += len(block)
                if closed:
                    os.fsync(f.fileno())
                    return sha.hexdigest()
                if done - synced >= self.SYNC_EVERY:
                    os.fdatasync(f.fileno())
                    synced = done


@dataclass
class _FullShard:
    """A shard whose last row is written, being sealed in the background."""

    tmp: Path
    sealed: Future  # -> sha256, from _Sealer.run
    record: ShardRecord


class ShardWriter:
    """Appends rows to the current shard of one rank; starts a new shard past `max_shard_bytes`.

    Hashing and fsyncing a shard take as long as writing it, so a background thread does both while
    the shard is being written (following the file) and finishes after it is closed, while the next
    shard is written; the rename and the journal line follow in shard order on the caller's thread
    (at the next `append`, or at `commit`). A shard is renamed only once durable, and journaled only
    once renamed.

    `on_journal(shard_path | None)` is called after each journal line is durable, with the path of
    the shard it committed (None for a skipped sample): extraction to a remote cache uploads there.
    """

    def __init__(
        self,
        root: Path,
        rank: int,
        spec: dict,
        first_index: int = 0,
        max_shard_bytes: int = 512 << 20,
        on_journal: Callable[[str | None], None] = lambda shard_path: None,
    ):
        self.root = Path(root)
        self.rank = rank
        self.next_index = first_index
        self.max_shard_bytes = max_shard_bytes
        self.on_journal = on_journal
        (self.root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        (self.root / JOURNAL_DIR).mkdir(parents=True, exist_ok=True)
        self.journal_path = self.root / JOURNAL_DIR / f"r{rank}.jsonl"
        if not self.journal_path.exists() or self.journal_path.stat().st_size == 0:
            append_journal(self.journal_path, {"spec": spec})
        self._open: tuple[Path, pa.NativeFile, pa.RecordBatchFileWriter, _Sealer, Future] | None = None
        self._rows: list[tuple[int, int, str | None]] = []
        self._hidden_bytes = 0
        self._sealing: deque[_FullShard] = deque()

    def append(self, row: Row) -> None:
        """Add a row; a row that fills the shard closes it (it is committed in the background)."""
        if self._open is None:
            tmp = self.root / SHARD_DIR / (shard_name(self.rank, self.next_index) + TMP_SUFFIX)
            sink = pa.OSFile(str(tmp), "wb")
            writer = pa.ipc.new_file(sink, ROW_SCHEMA)
            sealer = _Sealer(tmp)
            self._open = (tmp, sink, writer, sealer, sealer.start())
        _, sink, writer, sealer, _ = self._open
        writer.write_batch(row.record_batch)
        sealer.grew(sink.tell())
        self._rows.append((row.sample_id, row.num_tokens, row.record_id))
        self._hidden_bytes += len(row.hidden) + len(row.hidden_scales or b"")
        if sink.tell() >= self.max_shard_bytes:
            self._close_shard()
        self._journal_sealed(wait=False)

    def commit(self) -> None:
        """Close the current shard and wait until every shard is durable, renamed and journaled."""
        self._close_shard()
        self._journal_sealed(wait=True)

    def _close_shard(self) -> None:
        if self._open is None:
            return
        tmp, sink, writer, sealer, sealed = self._open
        writer.close()
        size = sink.tell()
        sink.close()
        sealer.grew(size, closed=True)
        final = shard_name(self.rank, self.next_index)
        record = ShardRecord(
            path=f"{SHARD_DIR}/{final}",
            rows=len(self._rows),
            tokens=sum(n for _, n, _ in self._rows),
            bytes=size,
            hidden_bytes=self._hidden_bytes,
            sha256="",
            sample_ids=[s for s, _, _ in self._rows],
            num_tokens=[n for _, n, _ in self._rows],
            record_ids=[r for _, _, r in self._rows] if any(r is not None for _, _, r in self._rows) else [],
        )
        self._sealing.append(_FullShard(tmp, sealed, record))
        self._open, self._rows, self._hidden_bytes = None, [], 0
        self.next_index += 1

    def _journal_sealed(self, wait: bool) -> None:
        """Rename and journal the sealed shards at the front of the queue (all of them if `wait`)."""
        while self._sealing and (wait or self._sealing[0].sealed.done()):
            full = self._sealing[0]
            full.record.sha256 = full.sealed.result()
            faults.point("shard.before_rename")
            final = self.root / full.record.path
            os.replace(full.tmp, final)
            fsync_dir(final.parent)
            faults.point("shard.before_journal")
            append_journal(self.journal_path, {"shard": full.record.__dict__})
            faults.point("shard.committed")
            self._sealing.popleft()
            self.on_journal(full.record.path)

    def skip(self, sample_id: int, reason: str) -> None:
        """Record a sample that will never be stored (a bad sample under --on-bad-sample skip)."""
        append_journal(self.journal_path, {"skipped": {"sample_id": sample_id, "reason": reason}})
        self.on_journal(None)

    def record_target_files(self, hashes: dict[str, str]) -> None:
        """Record the sha256 of each file written to target/, for the manifest to vouch for them."""
        append_journal(self.journal_path, {"target_files": hashes})
        self.on_journal(None)

    def abort(self) -> None:
        """After an error: drop the shard being written (nothing of it is ever listed) and commit the
        full shards already being sealed, where that still works."""
        if self._open is not None:
            tmp, sink, writer, sealer, _ = self._open
            try:
                writer.close()
                sink.close()
            except Exception:  # noqa: BLE001 - the disk may be full; the file goes either way
                pass
            sealer.grew(sealer.written, closed=True)  # let it end; its hash is never used
            tmp.unlink(missing_ok=True)
            self._open, self._rows, self._hidden_bytes = None, [], 0
        try:
            self._journal_sealed(wait=True)
        except Exception:  # noqa: BLE001 - the first error is the one reported; a rerun deletes leftovers
            self._sealing.clear()
