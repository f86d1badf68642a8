"""Shard files: an Arrow IPC file per shard, one record batch per sample (FORMAT.md).

What the writer (store/writer.py), the journals (store/journal.py) and the reader (store/reader.py)
share: where shards live, their names, and the record a journal lists for each committed shard.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

SHARD_DIR = "shards"
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
