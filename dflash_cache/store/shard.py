"""Shard files: an Arrow IPC file per shard, one record batch per sample.

`ShardWriter` writes a shard under a temporary name, fsyncs it, renames it into place and only then
records it in the rank's journal. A shard that is not in a journal does not exist as far as every
reader is concerned; a rerun deletes such leftovers.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import resource
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash_cache.errors import DFlashCacheError
from dflash_cache.files import faults
from dflash_cache.store.schema import ROW_SCHEMA, ROW_SCHEMA_V1, Row, row_checksum

SHARD_DIR = "shards"
JOURNAL_DIR = "journal"
TMP_SUFFIX = ".tmp"


@dataclass
class ShardRecord:
    """A committed shard, as listed in a journal and the manifest."""

    path: str  # relative to the cache root
    rows: int
    tokens: int
    bytes: int
    hidden_bytes: int
    sha256: str
    sample_ids: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    record_ids: list[str | None] = field(default_factory=list)  # per row; empty when no row has one


def shard_name(rank: int, index: int) -> str:
    return f"r{rank}-{index:05d}.arrow"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path, chunk: int = 8 << 20) -> str:
    sha = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(chunk):
            sha.update(block)
    return sha.hexdigest()


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


def append_journal(path: Path, entry: dict) -> None:
    """Append one JSON line and fsync. A write that fails (a full disk, a file-size limit) is cut
    back, so the line is in the journal whole or not at all; a crash in the middle of the write
    leaves a torn last line, which `cut_torn_line` removes before the next append."""
    line = memoryview((json.dumps(entry, separators=(",", ":")) + "\n").encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            while line:
                line = line[os.write(fd, line) :]
            os.fsync(fd)
        except BaseException:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass  # the line stays torn; the next run cuts it
            raise
    finally:
        os.close(fd)


def cut_torn_line(path: Path, block: int = 1 << 16) -> int:
    """Cut a journal back to its last whole line; returns the number of bytes cut (0: none torn).
    Reads from the end, a block at a time: a journal of 100,000 shards is not read whole."""
    with open(path, "r+b") as f:
        size = end = f.seek(0, os.SEEK_END)
        whole = 0
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                whole = start + newline + 1
                break
            end = start
        if whole == size:
            return 0
        f.truncate(whole)
        f.flush()
        os.fsync(f.fileno())
    return size - whole


def read_journal(path: Path) -> Iterator[dict]:
    """A local journal's entries, read line by line: a journal of 100,000 shards is never held as
    text, lines and entries at once."""
    try:
        with open(path, encoding="utf-8") as f:
            yield from iter_journal(_pieces(f), str(path))
    except UnicodeDecodeError as e:
        raise DFlashCacheError(
            f"{path}: not UTF-8 text ({e}); restore the file, or delete it to extract that rank's samples again"
        ) from None


def parse_journal(text: str, where: str) -> list[dict]:
    return list(iter_journal(text.split("\n"), where))


def iter_journal(pieces: Iterable[str], where: str) -> Iterator[dict]:
    """Journal entries of a text split at its newlines; a torn last line (a crash mid-write) is
    ignored, a torn middle line is an error."""
    pieces = iter(pieces)
    ahead = list(itertools.islice(pieces, 2))  # the next two pieces: the last one is "" after a final newline
    number = 0
    while ahead:
        line = ahead.pop(0)
        ahead.extend(itertools.islice(pieces, 1))
        number += 1
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: a line nested 100,000 deep
            if len(ahead) <= 1:  # the last line, possibly without its newline
                return
            raise DFlashCacheError(f"{where}:{number}: corrupt journal line") from None


def _pieces(lines: Iterable[str]) -> Iterator[str]:
    """A file's lines as `text.split("\\n")` gives them."""
    last = None
    for last in lines:
        yield last.removesuffix("\n")
    if last is None or last.endswith("\n"):
        yield ""


@dataclass
class StoredRow:
    """One row read back from a shard, still compressed; `check()` verifies its checksum."""

    sample_id: int
    input_ids: np.ndarray
    loss_mask: np.ndarray
    target_ids: np.ndarray
    topk_ids: np.ndarray | None
    topk_logprobs: np.ndarray | None
    hidden: memoryview
    hidden_scales: memoryview | None
    checksum: int
    record_id: str | None = None

    def check(self) -> bool:
        found = row_checksum(
            self.input_ids,
            self.loss_mask,
            self.target_ids,
            self.topk_ids,
            self.topk_logprobs,
            self.hidden,
            self.hidden_scales,
            self.record_id,
        )
        return found == self.checksum


def _list_values(column: pa.ListArray, dtype) -> np.ndarray | None:
    if column.null_count:
        return None
    return column.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _binary_value(column: pa.Array) -> memoryview | None:
    """The one value of a binary column, a view of the record batch's memory. Indexing the column
    would copy the value with the GIL held: tens of MB per row, stalling the training thread."""
    if column.null_count:
        return None
    _, offsets, data = column.buffers()
    width = 8 if pa.types.is_large_binary(column.type) else 4
    start, end = np.frombuffer(offsets, dtype=f"<i{width}", count=2, offset=column.offset * width)
    return memoryview(data or b"")[int(start) : int(end)]


def exhausted_limit(e: OSError) -> str | None:
    """The one-line message for a process limit that opening a shard ran into, with how to raise it."""
    if e.errno in (errno.EMFILE, errno.ENFILE):
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (
            f"out of file descriptors opening a shard (ulimit -n is {soft}): raise it (`ulimit -n 65536`), "
            "or lower --max-open-shards"
        )
    if e.errno == errno.ENOMEM or "Cannot allocate memory" in str(e):  # pyarrow's mmap failure has no errno
        return (
            "cannot memory-map a shard (out of memory maps or address space): raise `sysctl vm.max_map_count` "
            "(default 65530) or `ulimit -v`, or lower --max-open-shards"
        )
    return None


class ShardReader:
    """Random access to the rows of one shard file without reading the whole file: memory-mapped, or
    through `source` (a file-like object of a remote shard, read by byte ranges)."""

    def __init__(self, path: Path | str, source=None):
        self.path = path
        try:
            self._source = pa.memory_map(str(path), "r") if source is None else pa.PythonFile(source, mode="r")
            self._reader = pa.ipc.open_file(self._source)
        except FileNotFoundError:
            raise  # the caller names the missing shard
        except OSError as e:
            raise DFlashCacheError(exhausted_limit(e) or f"{self.path}: cannot open shard ({e})") from None
        except pa.ArrowInvalid as e:
            raise DFlashCacheError(f"{self.path}: cannot open shard ({e})") from None
        self._has_record_id = self._reader.schema.equals(ROW_SCHEMA)
        if not (self._has_record_id or self._reader.schema.equals(ROW_SCHEMA_V1)):  # version 1: no record ids
            raise DFlashCacheError(f"{self.path}: unexpected schema")

    def sha256(self, chunk: int = 8 << 20) -> str:
        """sha256 of the whole file, read through this reader's own open file."""
        sha = hashlib.sha256()
        size = self._source.size()
        for start in range(0, size, chunk):
            sha.update(self._source.read_at(min(chunk, size - start), start))
        return sha.hexdigest()

    @property
    def num_rows(self) -> int:
        return self._reader.num_record_batches

    def row(self, index: int) -> StoredRow:
        try:
            batch = self._reader.get_batch(index)
            # Arrow checks lengths, buffer sizes and offsets only when asked: a crafted shard whose field
            # lengths say 2^40 crashed the reader (SIGBUS, SIGSEGV) as its columns were read. A row's
            # batch holds one value per column, so the full check costs about 1 us.
            batch.validate(full=True)
            return StoredRow(
                sample_id=batch.column("sample_id")[0].as_py(),
                input_ids=_list_values(batch.column("input_ids"), np.int32),
                loss_mask=_list_values(batch.column("loss_mask"), bool),
                target_ids=_list_values(batch.column("target_ids"), np.int32),
                topk_ids=_list_values(batch.column("topk_ids"), np.int32),
                topk_logprobs=_list_values(batch.column("topk_logprobs"), np.float32),
                hidden=_binary_value(batch.column("hidden")),
                hidden_scales=_binary_value(batch.column("hidden_scales")),
                checksum=batch.column("checksum")[0].as_py(),
                record_id=batch.column("record_id")[0].as_py() if self._has_record_id else None,
            )
        except (pa.ArrowInvalid, pa.ArrowIndexError, IndexError, ValueError, OSError) as e:
            raise DFlashCacheError(f"{self.path}: row {index} unreadable ({e})") from None

    def close(self) -> None:
        self._source.close()
