"""Extraction to a remote cache: each rank writes to a local staging folder exactly as to a local
cache, and every journal line is followed by uploads, in this order:

    shards/NAME (the shard just committed) -> journal/rR.jsonl (the whole file) -> delete the local shard

Object stores publish an object only once its upload completes, so the remote journal lists only
shards that are whole remotely, and the remote cache follows the same commit protocol as a local one
(FORMAT.md); the manifest goes up last. On a rerun the remote is the truth: `reconcile` first uploads
what a killed run had committed locally but not uploaded, or drops a staging journal that does not
continue the remote one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.journal import JOURNAL_DIR, parse_journal
from dflash_cache.store.paths import check_shard_path
from dflash_cache.store.remote import RemoteDir
from dflash_cache.store.shard import SHARD_DIR

TARGET_DIR = "target"
HEAD_FILE = "head.safetensors"


def default_staging(url: str) -> Path:
    """A staging folder of its own for each remote cache, the same in every run on this machine."""
    return Path(tempfile.gettempdir()) / "dflash-cache-staging" / hashlib.sha256(url.encode()).hexdigest()[:16]


def _whole_lines(text: str) -> str:
    return text[: text.rfind("\n") + 1]


def _first_spec(journal: str) -> dict | None:
    try:
        return json.loads(journal.split("\n", 1)[0]).get("spec")
    except (json.JSONDecodeError, AttributeError):
        return None


class Uploader:
    """Uploads one rank's commits from `staging` to `remote`; called by its ShardWriter after each
    journal line (runs on the writer thread: an upload overlaps the target's forward passes)."""

    def __init__(self, remote: RemoteDir, staging: Path, rank: int):
        self.remote, self.staging, self.rank = remote, Path(staging), rank
        self.journal = f"{JOURNAL_DIR}/r{rank}.jsonl"

    def __call__(self, shard_path: str | None) -> None:
        if shard_path is not None:
            self.remote.upload(self.staging / shard_path, shard_path)
        self.remote.upload(self.staging / self.journal, self.journal)
        if shard_path is not None:
            (self.staging / shard_path).unlink()  # listed remotely now: the staging folder stays small

    def upload_target(self) -> None:
        """The target/ files, head.safetensors last: its presence says the folder is whole."""
        folder = self.staging / TARGET_DIR
        for name in sorted((p.name for p in folder.iterdir()), key=lambda n: (n == HEAD_FILE, n)):
            self.remote.upload(folder / name, f"{TARGET_DIR}/{name}")

    def reconcile(self, spec: dict) -> None:
        """Bring this rank's staging journal in line with the remote one before extraction starts."""
        local = self.staging / self.journal
        remote_text = (
            _whole_lines(self.remote.read_bytes(self.journal).decode()) if self.remote.exists(self.journal) else ""
        )
        local_text = local.read_text() if local.is_file() else ""
        whole = _whole_lines(local_text)  # without a torn last line
        if whole.startswith(remote_text) and whole != remote_text and _first_spec(whole) == spec:
            try:
                pending = [
                    check_shard_path(e["shard"]["path"])
                    for e in parse_journal(whole[len(remote_text) :], str(local))
                    if "shard" in e
                ]
            except (KeyError, TypeError, ValueError) as e:
                raise DFlashCacheError(
                    f"{local}: corrupt entry ({e}); delete it to extract that rank's samples again"
                ) from None
            if all((self.staging / p).is_file() for p in pending):  # committed here, not uploaded: upload now
                for path in pending:
                    self.remote.upload(self.staging / path, path)
                self.remote.write_bytes(self.journal, whole.encode())
                remote_text = whole
        if local_text != remote_text:
            _write_atomic(local, remote_text)  # the remote is the truth; samples it lacks are recomputed
        for path in (self.staging / SHARD_DIR).glob(f"r{self.rank}-*"):
            path.unlink()  # uploaded, or never committed


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
