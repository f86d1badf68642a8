"""A cache being written: its folder checked and locked, resumed from its journals, finalised.

`extract` opens the cache (`WritableCache.open`), resumes it once the spec and the data are known
(`resume`: the one place where what an earlier run left is checked and repaired), and finalises it
when its ranks are done (`finalise`: the manifest, once the journals cover every sample).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_cache.data.rowbits import RowBits
from dflash_cache.errors import DFlashCacheError
from dflash_cache.files.folders import check_holds_only
from dflash_cache.files.lock import LOCK_DIR, FolderLock, make_folder
from dflash_cache.store.cache import TARGET_DIR
from dflash_cache.store.journal import JOURNAL_DIR, cut_torn_line
from dflash_cache.store.manifest import (
    MANIFEST,
    CommittedShards,
    build_manifest,
    read_journals,
    scan_journals,
    spec_differences,
    write_manifest,
    write_remote_manifest,
)
from dflash_cache.store.remote import RemoteDir, is_remote, local_path
from dflash_cache.store.shard import SHARD_DIR, TMP_SUFFIX
from dflash_cache.store.staging import Uploader, default_staging

HEAD = f"{TARGET_DIR}/head.safetensors"

# Every name a cache folder may hold. store/manifest.py's _STARTED_CACHE differs on purpose: the
# names that show an extraction began there (locks/cache.lock, not locks/, which a run folder has too).
CACHE_ENTRIES = {MANIFEST, MANIFEST + ".tmp", TARGET_DIR, SHARD_DIR, JOURNAL_DIR, LOCK_DIR}

RowsOf = Callable[[np.ndarray], np.ndarray]  # sample ids -> their rows in the data, -1 where absent


@dataclass
class Resumed:
    """What the journals say an earlier run already did."""

    done: RowBits  # over the data's rows: committed or skipped samples
    next_index: dict[int, int]  # rank: the index of its next shard
    target_files_done: bool  # journaled, and the head is there (a run may die before journaling a partial head)


class WritableCache:
    """The cache folder an extraction writes: local, or a remote URL written through a local staging
    folder (`root`) whose journals and manifest live at the remote (`store`)."""

    def __init__(self, out: Path | str, staging: Path | None):
        self.remote = RemoteDir(str(out)) if is_remote(out) else None
        if self.remote is None:
            self.root = local_path(out)
        else:
            self.root = Path(staging) if staging else default_staging(self.remote.url)
        self.store: Path | RemoteDir = self.remote or self.root  # where the journals and the manifest live
        self.writing = False  # until `resume`, a failed run leaves the folder as it found it
        self._made_root = False
        self._lock: FolderLock | None = None

    @classmethod
    def open(cls, out: Path | str, staging: Path | None, launch: str | None) -> WritableCache:
        """Check and lock the folder; `launch`: the key shared by the ranks of one torchrun launch."""
        cache = cls(out, staging)
        # An existing folder is resumed only if it holds nothing but a cache's own entries.
        check_holds_only(cache.root, CACHE_ENTRIES, "--staging" if cache.remote else "--out", "part of a cache")
        cache._made_root = not cache.root.exists()
        make_folder(cache.root)
        cache._lock = FolderLock(cache.root, "cache").acquire(launch)
        return cache

    def resume(
        self, spec: dict, rows_of: RowsOf, rows: int, ranks: list[int], every_rank: bool, on_note: Callable[[str], None]
    ) -> Resumed:
        """Check that the cache was made with `spec`, then repair what a crash left for `ranks` (this
        process's): torn journal lines cut, shard files no journal lists deleted (or, remote, the
        staging folder reconciled with the remote journals). `every_rank`: this process runs every
        rank, so any rank's leftovers are its own to delete."""
        owned = None if every_rank else ranks
        scan = scan_journals(self.store, rows_of, rows, owned)
        if scan.spec is not None and scan.spec != spec:
            diffs = "; ".join(spec_differences(scan.spec, spec))
            raise DFlashCacheError(f"{self.store} holds a cache made with other settings ({diffs}); use another --out")
        if self._exists(MANIFEST) and scan.spec is None:
            raise DFlashCacheError(
                f"{self.store} has a manifest but no journals; it was not written by extract, use another --out"
            )
        self.writing = True
        for rank in ranks:  # this run's own journals only: another launch's ranks may be appending to theirs
            self._cut_torn_journal(self.root / JOURNAL_DIR / f"r{rank}.jsonl", on_note)
        if self.remote is not None:
            for rank in ranks:
                Uploader(self.remote, self.root, rank).reconcile(spec)
            scan = scan_journals(self.remote, rows_of, rows, owned)
        else:
            self._remove_uncommitted(scan.committed, owned)
        return Resumed(scan.done, scan.next_index, scan.target_files is not None and self._exists(HEAD))

    def uploader(self, rank: int) -> Uploader | None:
        return None if self.remote is None else Uploader(self.remote, self.root, rank)

    def finalise(self, rows_of: RowsOf, rows: int, report: dict) -> dict | None:
        """Write the manifest once the journals cover every sample and the target head is there (under
        torchrun, the last rank to finish does it; two ranks doing it at once write the same bytes).
        Only that rank holds every shard record: the others see from a scan that the cache is not
        complete."""
        if scan_journals(self.store, rows_of, rows).done.count() < rows or not self._exists(HEAD):
            return None
        manifest = build_manifest(read_journals(self.store), {"extract": report})
        if self.remote is not None:
            write_remote_manifest(self.remote, manifest)
        else:
            write_manifest(self.root, manifest)
        return manifest

    def close(self, failed: bool = False) -> None:
        """Release the lock; a run that failed before writing leaves no folder it made."""
        if self._lock is not None:
            self._lock.release(discard=failed and not self.writing)
        if failed and self._made_root and not self.writing and not any(self.root.iterdir()):
            self.root.rmdir()

    def _exists(self, rel: str) -> bool:
        return self.remote.exists(rel) if self.remote is not None else (self.root / rel).exists()

    @staticmethod
    def _cut_torn_journal(path: Path, on_note: Callable[[str], None]) -> None:
        """A crash while a journal line was appended leaves it torn: cut it before anything is appended."""
        if path.is_file() and (cut := cut_torn_line(path)):
            on_note(
                f"{path}: cut a torn last line ({cut} bytes, left by a crash while it was written); "
                "what it recorded is extracted again"
            )

    def _remove_uncommitted(self, committed: CommittedShards, ranks: list[int] | None) -> None:
        """Delete shard files no journal lists (a crash between write and journal); `ranks` None: all."""
        for path in (self.root / SHARD_DIR).glob("r*-*.arrow*"):
            rank = int(path.name[1:].split("-")[0])
            if ranks is not None and rank not in ranks:
                continue
            if path.name.endswith(TMP_SUFFIX) or f"{SHARD_DIR}/{path.name}" not in committed:
                path.unlink()
