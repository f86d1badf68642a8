"""`ShardReader`: random access to the rows of a shard file, each row still compressed."""

from __future__ import annotations

import errno
import hashlib
import resource
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.schema import ROW_SCHEMA, ROW_SCHEMA_V1, row_checksum


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
