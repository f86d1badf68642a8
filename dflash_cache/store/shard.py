"""Shard files: an Arrow IPC file per shard, one record batch per sample.

`ShardWriter` writes a shard under a temporary name, fsyncs it, renames it into place and only then
records it in the rank's journal. A shard that is not in a journal does not exist as far as every
reader is concerned; a rerun deletes such leftovers.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash_cache import faults
from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.schema import ROW_SCHEMA, Row, row_checksum

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


class _HashingFile:
    """A file that hashes what goes through it, so the sha256 costs no second read."""

    def __init__(self, path: Path):
        self.file = open(path, "wb")
        self.sha = hashlib.sha256()
        self.size = 0
        self.closed = False

    def write(self, data) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.size += view.nbytes
        return self.file.write(view)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        if not self.closed:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.closed = True


def shard_name(rank: int, index: int) -> str:
    return f"r{rank}-{index:05d}.arrow"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardWriter:
    """Appends rows to the current shard of one rank; starts a new shard past `max_shard_bytes`.

    `on_journal(shard_path | None)` is called after each journal line is durable, with the path of
    the shard it committed (None for a skipped sample): extraction to a remote cache uploads there.
    """

    def __init__(self, root: Path, rank: int, spec: dict, first_index: int = 0, max_shard_bytes: int = 512 << 20,
                 on_journal: Callable[[str | None], None] = lambda shard_path: None):
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
        self._open: tuple[Path, _HashingFile, pa.RecordBatchFileWriter] | None = None
        self._rows: list[tuple[int, int]] = []
        self._hidden_bytes = 0

    def append(self, row: Row) -> ShardRecord | None:
        """Add a row; returns the shard record when this row filled (and committed) a shard."""
        if self._open is None:
            tmp = self.root / SHARD_DIR / (shard_name(self.rank, self.next_index) + TMP_SUFFIX)
            sink = _HashingFile(tmp)
            self._open = (tmp, sink, pa.ipc.new_file(pa.PythonFile(sink, mode="w"), ROW_SCHEMA))
        _, sink, writer = self._open
        writer.write_batch(row.record_batch)
        self._rows.append((row.sample_id, row.num_tokens))
        self._hidden_bytes += len(row.hidden) + len(row.hidden_scales or b"")
        if sink.size >= self.max_shard_bytes:
            return self.commit()
        return None

    def commit(self) -> ShardRecord | None:
        """Close the current shard, make it durable, rename it into place, then journal it."""
        if self._open is None:
            return None
        tmp, sink, writer = self._open
        writer.close()
        sink.close()
        faults.point("shard.before_rename")
        final = tmp.with_name(tmp.name[: -len(TMP_SUFFIX)])
        os.replace(tmp, final)
        fsync_dir(final.parent)
        faults.point("shard.before_journal")
        record = ShardRecord(
            path=f"{SHARD_DIR}/{final.name}",
            rows=len(self._rows),
            tokens=sum(n for _, n in self._rows),
            bytes=sink.size,
            hidden_bytes=self._hidden_bytes,
            sha256=sink.sha.hexdigest(),
            sample_ids=[s for s, _ in self._rows],
            num_tokens=[n for _, n in self._rows],
        )
        append_journal(self.journal_path, {"shard": record.__dict__})
        faults.point("shard.committed")
        self._open, self._rows, self._hidden_bytes = None, [], 0
        self.next_index += 1
        self.on_journal(record.path)
        return record

    def skip(self, sample_id: int, reason: str) -> None:
        """Record a sample that will never be stored (a bad sample under --on-bad-sample skip)."""
        append_journal(self.journal_path, {"skipped": {"sample_id": sample_id, "reason": reason}})
        self.on_journal(None)

    def record_target_files(self, hashes: dict[str, str]) -> None:
        """Record the sha256 of each file written to target/, for the manifest to vouch for them."""
        append_journal(self.journal_path, {"target_files": hashes})
        self.on_journal(None)

    def abort(self) -> None:
        """Drop the shard being written (after an error); nothing of it is ever listed."""
        if self._open is not None:
            tmp, sink, writer = self._open
            try:
                writer.close()
                sink.close()
            except Exception:  # noqa: BLE001 - the disk may be full; the file goes either way
                pass
            tmp.unlink(missing_ok=True)
            self._open, self._rows, self._hidden_bytes = None, [], 0


def append_journal(path: Path, entry: dict) -> None:
    """Append one JSON line and fsync: a journal line is either whole or absent after a crash."""
    with open(path, "a") as f:
        f.write(json.dumps(entry, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_journal(path: Path) -> list[dict]:
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as e:
        raise DFlashCacheError(f"{path}: not UTF-8 text ({e}); restore the file, or delete it to extract that rank's "
                               "samples again") from None
    return parse_journal(text, str(path))


def parse_journal(text: str, where: str) -> list[dict]:
    """Journal entries; a torn last line (a crash mid-write) is ignored, a torn middle line is an error."""
    lines = text.split("\n")
    entries = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            if i >= len(lines) - 2:  # the last line, possibly without its newline
                break
            raise DFlashCacheError(f"{where}:{i + 1}: corrupt journal line") from None
    return entries


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
    hidden_scales: bytes | None
    checksum: int

    def check(self) -> bool:
        found = row_checksum(self.input_ids, self.loss_mask, self.target_ids, self.topk_ids, self.topk_logprobs, self.hidden, self.hidden_scales)
        return found == self.checksum


def _list_values(column: pa.ListArray, dtype) -> np.ndarray | None:
    if column.null_count:
        return None
    return column.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


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
        except (OSError, pa.ArrowInvalid) as e:
            raise DFlashCacheError(f"{self.path}: cannot open shard ({e})") from None
        if not self._reader.schema.equals(ROW_SCHEMA):
            raise DFlashCacheError(f"{self.path}: unexpected schema")

    @property
    def num_rows(self) -> int:
        return self._reader.num_record_batches

    def row(self, index: int) -> StoredRow:
        try:
            batch = self._reader.get_batch(index)
            scales = batch.column("hidden_scales")[0].as_py()
            return StoredRow(
                sample_id=batch.column("sample_id")[0].as_py(),
                input_ids=_list_values(batch.column("input_ids"), np.int32),
                loss_mask=_list_values(batch.column("loss_mask"), bool),
                target_ids=_list_values(batch.column("target_ids"), np.int32),
                topk_ids=_list_values(batch.column("topk_ids"), np.int32),
                topk_logprobs=_list_values(batch.column("topk_logprobs"), np.float32),
                hidden=memoryview(batch.column("hidden")[0].as_buffer()),
                hidden_scales=scales,
                checksum=batch.column("checksum")[0].as_py(),
            )
        except (pa.ArrowInvalid, pa.ArrowIndexError, IndexError, OSError) as e:
            raise DFlashCacheError(f"{self.path}: row {index} unreadable ({e})") from None

    def close(self) -> None:
        self._source.close()
