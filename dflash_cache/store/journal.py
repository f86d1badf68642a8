"""The journals: one JSON line per committed shard, skipped sample or target files, appended and
fsynced by each rank (`journal/r{rank}.jsonl`); what they list is what the cache holds."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from dflash_cache.errors import DFlashCacheError

JOURNAL_DIR = "journal"


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
