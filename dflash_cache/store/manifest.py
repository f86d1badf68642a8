"""`manifest.json`: the one file that says a cache is complete, built from the per-rank journals.

Building is a pure function of the journals (sorted by shard path), so merging twice gives the same
manifest; it is written to a temporary name and renamed, so readers see the old one or the new one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from array import array
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_cache.data.rowbits import RowBits
from dflash_cache.errors import DFlashCacheError
from dflash_cache.files import faults
from dflash_cache.files.lock import FolderLock
from dflash_cache.files.write_errors import write_failed
from dflash_cache.store.codecs import CODECS, MAX_EXPANSION, encoded_size, stored_width
from dflash_cache.store.journal import JOURNAL_DIR, iter_journal, read_journal
from dflash_cache.store.paths import check_shard_path, is_file_name
from dflash_cache.store.remote import RemoteDir
from dflash_cache.store.schema import FORMAT_NAME, FORMAT_VERSION
from dflash_cache.store.shard import SHARD_DIR, ShardRecord, fsync_dir, shard_name
from dflash_cache.store.subspace import GROUP, is_subspace

MANIFEST = "manifest.json"


@dataclass
class JournalState:
    """What the journals of a cache say: its spec, committed shards and skipped samples."""

    spec: dict | None
    shards: list[ShardRecord]
    skipped: list[dict]  # {"sample_id", "reason"}
    target_files: dict[str, str] | None = None  # sha256 of each file in target/, when extract wrote them

    def done_sample_ids(self) -> set[int]:
        done = {s["sample_id"] for s in self.skipped}
        for shard in self.shards:
            done.update(shard.sample_ids)
        return done

    def done_ids(self) -> np.ndarray:
        """`done_sample_ids()` as a sorted int64 array (8 bytes a sample, where a set of ints costs ~60)."""
        ids = itertools.chain((s["sample_id"] for s in self.skipped), *(s.sample_ids for s in self.shards))
        count = len(self.skipped) + sum(len(s.sample_ids) for s in self.shards)
        return np.unique(np.fromiter(ids, dtype=np.int64, count=count))


def _journals(root: Path | RemoteDir) -> Iterator[tuple[str, Iterable[dict]]]:
    """(where, entries) of every rank's journal, in name order; a local one is read as its entries are taken."""
    if isinstance(root, RemoteDir):
        names = [n for n in root.list(JOURNAL_DIR) if n.startswith("r") and n.endswith(".jsonl")]
        for p in (f"{JOURNAL_DIR}/{n}" for n in names):
            yield root.url_of(p), iter_journal(root.read_bytes(p).decode().split("\n"), root.url_of(p))
        return
    for p in sorted((Path(root) / JOURNAL_DIR).glob("r*.jsonl")):
        yield str(p), read_journal(p)


def _entries(root: Path | RemoteDir) -> Iterator[tuple[str, str, object]]:
    """(journal, kind, value) of every entry of every journal, checked: kind "spec" (a dict, the same
    in every journal), "shard" (a ShardRecord), "skipped" ({"sample_id", "reason"}) or "target_files"."""
    spec = None
    for path, entries in _journals(root):
        for entry in entries:
            try:
                if "spec" in entry:
                    if not isinstance(entry["spec"], dict):
                        raise ValueError("the spec is not an object")
                    if spec is not None and entry["spec"] != spec:
                        raise DFlashCacheError(f"{path}: spec differs from the other journals")
                    spec = entry["spec"]
                    item = ("spec", spec)
                elif "shard" in entry:
                    item = ("shard", shard_record(entry["shard"]))
                elif "skipped" in entry:
                    if not _counts([entry["skipped"]["sample_id"]]):
                        raise ValueError("a skipped sample id is not an integer")
                    item = ("skipped", entry["skipped"])
                elif "target_files" in entry:
                    item = ("target_files", target_file_list(entry["target_files"]))
                else:
                    continue
            except (KeyError, TypeError, ValueError) as e:
                raise DFlashCacheError(
                    f"{path}: corrupt entry ({e}); restore the file, or delete it to extract that rank's samples again"
                ) from None
            yield path, *item


def read_journals(root: Path | RemoteDir) -> JournalState:
    spec, shards, skipped, target_files = None, {}, {}, None
    for _, kind, value in _entries(root):
        if kind == "spec":
            spec = value
        elif kind == "shard":
            shards[value.path] = value
        elif kind == "skipped":
            skipped[value["sample_id"]] = value
        else:
            target_files = value
    return JournalState(spec, [shards[p] for p in sorted(shards)], [skipped[s] for s in sorted(skipped)], target_files)


@dataclass
class JournalScan:
    """What a starting extraction rank needs of the journals, without their shard records (about a
    kilobyte each as Python objects: 100 MB at 100,000 shards, on every rank, since a resumed run
    may have another world size and so any rank's samples)."""

    spec: dict | None
    target_files: dict[str, str] | None
    done: RowBits  # the rows of the data scanned for whose samples are committed or skipped
    committed: CommittedShards  # `path in committed` for the shards of the ranks asked for
    next_index: dict[int, int]  # rank: the index of its next shard (after its last committed one)


class CommittedShards:
    """Committed shard paths, for `path in committed`: held as each rank's shard indices (8 bytes a
    shard, where a set of paths costs ~100) when the journals are as extract writes them."""

    def __init__(self, paths: set[str] | None = None, indices: dict[int, np.ndarray] | None = None):
        self.paths = paths or set()
        self.indices = indices or {}  # rank: its committed shards' indices, increasing

    def __contains__(self, path: object) -> bool:
        if path in self.paths:
            return True
        m = _RANK_SHARD.fullmatch(path) if isinstance(path, str) else None
        if m is None or path != f"{SHARD_DIR}/{shard_name(int(m[1]), int(m[2]))}" or int(m[1]) not in self.indices:
            return False
        found, index = self.indices[int(m[1])], int(m[2])
        i = int(np.searchsorted(found, index))
        return i < len(found) and found[i] == index


class _NotInOrder(Exception):
    """A journal that `ShardWriter` did not write as it writes them (see scan_journals)."""


_RANK_JOURNAL = re.compile(r"r(0|[1-9][0-9]*)\.jsonl")
_RANK_SHARD = re.compile(rf"{SHARD_DIR}/r(0|[1-9][0-9]*)-([0-9]+)\.arrow")
SCAN_CHUNK = 1 << 16  # sample ids looked up at once


def scan_journals(
    root: Path | RemoteDir, rows_of: Callable[[np.ndarray], np.ndarray], rows: int, ranks: Collection[int] | None = None
) -> JournalScan:
    """The journals' spec, target files and next shard indices; which of `rows` data rows are done
    (`rows_of(sample_ids)`: their rows, -1 for an id the data does not hold, which is left out as
    `read_journals(root).done_ids()` would be by the caller); the committed shard paths of `ranks`
    (None: all). Holds a bit a data row and the paths asked for, whatever the number of shards.

    That a shard path listed twice is one shard (the last listing counts, as in `read_journals`) is
    seen without holding every path because `ShardWriter` journals rank R's shards in rR.jsonl,
    named shards/rR-INDEX.arrow (`shard_name`) with increasing indices; journals that are not so
    (written by hand) are read whole by `read_journals` instead."""
    try:
        return _scan(root, rows_of, rows, ranks)
    except _NotInOrder:
        pass
    state = read_journals(root)
    done = RowBits(rows)
    _mark(done, rows_of, state.done_ids())
    next_index: dict[int, int] = {}
    for shard in state.shards:
        if m := _RANK_SHARD.fullmatch(shard.path):
            rank = int(m.group(1))
            next_index[rank] = max(next_index.get(rank, 0), int(m.group(2)) + 1)
    return JournalScan(
        state.spec, state.target_files, done, CommittedShards({s.path for s in state.shards}), next_index
    )


def _scan(
    root: Path | RemoteDir, rows_of: Callable[[np.ndarray], np.ndarray], rows: int, ranks: Collection[int] | None
) -> JournalScan:
    spec = target_files = None
    done, pending = RowBits(rows), array("q")
    committed: dict[int, array] = {}
    next_index: dict[int, int] = {}
    for where, kind, value in _entries(root):
        if kind == "spec":
            spec = value
        elif kind == "target_files":
            target_files = value
        elif kind == "skipped":
            pending.append(value["sample_id"])
        else:
            journal = _RANK_JOURNAL.fullmatch(where.rsplit("/", 1)[-1])
            shard = _RANK_SHARD.fullmatch(value.path)
            if not (journal and shard and journal.group(1) == shard.group(1)):
                raise _NotInOrder
            rank, index = int(shard.group(1)), int(shard.group(2))
            if index < next_index.get(rank, 0) or value.path != f"{SHARD_DIR}/{shard_name(rank, index)}":
                raise _NotInOrder
            next_index[rank] = index + 1
            if ranks is None or rank in ranks:
                committed.setdefault(rank, array("q")).append(index)
            pending.extend(value.sample_ids)
        if len(pending) >= SCAN_CHUNK:
            _mark(done, rows_of, np.frombuffer(pending, dtype=np.int64))
            pending = array("q")
    _mark(done, rows_of, np.frombuffer(pending, dtype=np.int64))
    indices = {rank: np.frombuffer(found, dtype=np.int64) for rank, found in committed.items()}
    return JournalScan(spec, target_files, done, CommittedShards(indices=indices), next_index)


def _mark(done: RowBits, rows_of: Callable[[np.ndarray], np.ndarray], sample_ids: np.ndarray) -> None:
    rows = rows_of(sample_ids)
    done.add(rows[rows >= 0])


def _counts(values) -> bool:
    return isinstance(values, list) and all(type(v) is int and v >= 0 for v in values)


def shard_record(entry: object) -> ShardRecord:
    """A shard entry of a journal or of the manifest, its fields checked (TypeError or ValueError if bad)."""
    record = ShardRecord(**entry)
    check_shard_path(record.path)
    if not (
        isinstance(record.path, str)
        and isinstance(record.sha256, str)
        and _counts(record.sample_ids)
        and _counts(record.num_tokens)
        and _counts([record.rows, record.tokens, record.bytes, record.hidden_bytes])
    ):
        raise ValueError(f"shard {record.path!r} has fields of the wrong type")
    if (
        len(record.sample_ids) != record.rows
        or len(record.num_tokens) != record.rows
        or sum(record.num_tokens) != record.tokens
    ):
        raise ValueError(f"shard {record.path} lists inconsistent rows")
    if not (
        isinstance(record.record_ids, list)
        and len(record.record_ids) in (0, record.rows)
        and all(r is None or isinstance(r, str) for r in record.record_ids)
    ):
        raise ValueError(f"shard {record.path} lists record ids that are not one string or null per row")
    return record


def target_file_list(entry: object) -> dict[str, str]:
    """{file name in target/: sha256}, checked (ValueError if bad)."""
    if not (isinstance(entry, dict) and all(isinstance(h, str) and is_file_name(n) for n, h in entry.items())):
        raise ValueError("target_files is not a list of file names and hashes")
    return entry


def manifest_checksum(manifest: dict) -> str:
    """sha256 of the manifest's JSON without its `checksum` key (sorted keys, compact separators)."""
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def length_histogram(lengths: list[int]) -> list[dict]:
    """Samples and tokens per power-of-two length range [2^k, 2^(k+1))."""
    bins: dict[int, list[int]] = {}
    for n in lengths:
        bins.setdefault(max(n, 1).bit_length() - 1, []).append(n)
    return [{"lo": 1 << k, "hi": 1 << (k + 1), "samples": len(v), "tokens": sum(v)} for k, v in sorted(bins.items())]


def build_manifest(state: JournalState, extra: dict | None = None) -> dict:
    if state.spec is None:
        raise DFlashCacheError("no journal holds a cache spec: nothing was extracted")
    lengths = [n for shard in state.shards for n in shard.num_tokens]
    tokens = sum(lengths)
    width = len(state.spec["layer_ids"]) * state.spec["target"]["hidden_size"]
    hidden_bytes = sum(s.hidden_bytes for s in state.shards)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "spec": state.spec,
        "shards": [s.__dict__ for s in state.shards],
        "skipped": state.skipped,
        "totals": {
            "samples": len(lengths),
            "tokens": tokens,
            "bytes": sum(s.bytes for s in state.shards),
            "hidden_bytes": hidden_bytes,
            "raw_hidden_bytes": tokens * width * 2,
        },
        "histogram": length_histogram(lengths),
        **({"target_files": state.target_files} if state.target_files else {}),
        **(extra or {}),
    }
    manifest["checksum"] = manifest_checksum(manifest)
    return manifest


def write_manifest(root: Path, manifest: dict) -> Path:
    path = Path(root) / MANIFEST
    tmp = path.with_name(MANIFEST + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(manifest, f, separators=(",", ":"))
            faults.point("manifest.write")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:  # a full disk: the journals hold everything, a rerun writes the manifest from them
        tmp.unlink(missing_ok=True)
        raise write_failed(path, root, e, "rerun the same extract command to finish the cache") from None
    return path


INCOMPLETE = "missing; the cache is incomplete (rerun the same extract command to finish it)"
REBUILD = "rerun the same extract command to rebuild it from the journals"


def write_remote_manifest(remote: RemoteDir, manifest: dict) -> None:
    """The same bytes as `write_manifest`, as one object (whole or absent)."""
    faults.point("manifest.write")
    remote.write_bytes(MANIFEST, json.dumps(manifest, separators=(",", ":")).encode())


# What an extraction makes before its manifest (its lock first): a folder with none of them is no cache.
_STARTED_CACHE = (JOURNAL_DIR, SHARD_DIR, "target", "locks/cache.lock")


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not Path(root).is_dir():
        raise DFlashCacheError(f"{root}: no such cache directory")
    if not path.is_file():
        if not any((Path(root) / name).exists() for name in _STARTED_CACHE):  # no extraction ever ran here
            raise DFlashCacheError(
                f"{root} is not a cache (it has no {MANIFEST} and no {JOURNAL_DIR}/); "
                "give a folder that `dflash-cache extract` wrote"
            )
        if holder := FolderLock(root, "cache").holder():  # not finished yet: rerunning extract would be refused
            raise DFlashCacheError(
                f"{path}: missing; {root} is being written by {holder} (an extraction that has not "
                "finished); wait for it to end"
            )
        raise DFlashCacheError(f"{path}: {INCOMPLETE}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DFlashCacheError(f"{path}: unreadable manifest ({e})") from None
    return parse_manifest(data, str(path))


def read_remote_manifest(remote: RemoteDir) -> dict:
    try:
        data = remote.read_bytes(MANIFEST)
    except FileNotFoundError:
        raise DFlashCacheError(f"{remote.url_of(MANIFEST)}: {INCOMPLETE}") from None
    return parse_manifest(data, remote.url_of(MANIFEST))


def parse_manifest(data: bytes, path: str) -> dict:
    try:
        manifest = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: nesting 100,000 deep
        raise DFlashCacheError(f"{path}: unreadable manifest ({e}); {REBUILD}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise DFlashCacheError(f"{path}: not a dflash-cache manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise DFlashCacheError(
            f"{path}: format version {version} is newer than this dflash-cache reads ({FORMAT_VERSION}); upgrade dflash-cache"
        )
    try:
        shards = [shard_record(s) for s in manifest["shards"]]
        spec = manifest["spec"]
        if spec["codec"] not in CODECS:
            raise ValueError(f"unknown codec {spec['codec']!r}")
        if not (spec["layer_ids"] and _counts(spec["layer_ids"]) and _counts([spec["target"]["hidden_size"]])):
            raise ValueError("the spec's layer ids or hidden size are not integers")
        if is_subspace(spec["codec"]):
            rank, width = spec["subspace"]["rank"], len(spec["layer_ids"]) * spec["target"]["hidden_size"]
            if not (_counts([rank]) and 0 < rank <= width and rank % GROUP == 0):
                raise ValueError(f"subspace rank {rank!r} is not a multiple of {GROUP} up to the width {width}")
        # Readers size their buffers by these counts before a row is read: a count past max_length
        # (2^40 tokens in a manifest someone shared) would be allocated first and checked after.
        if not _counts([spec["max_length"]]) or any(
            s.num_tokens and max(s.num_tokens) > spec["max_length"] for s in shards
        ):
            raise ValueError(f"a shard lists a sample longer than the spec's max_length {spec['max_length']!r}")
        _check_width(spec, shards)
        target_file_list(manifest.get("target_files", {}))
    except (KeyError, TypeError, ValueError) as e:
        raise DFlashCacheError(f"{path}: malformed manifest ({e}); {REBUILD}") from None
    if manifest.get("checksum") != manifest_checksum(manifest):
        problem = "has no checksum" if "checksum" not in manifest else "checksum does not match its content"
        raise DFlashCacheError(f"{path}: {problem} (edited by hand or damaged); {REBUILD}")
    manifest["shards"] = shards
    return manifest


def _check_width(spec: dict, shards: list[ShardRecord]) -> None:
    """The spec's width (layer ids x hidden size) must fit the bytes of every shard: readers size a
    row's (and a batch's) buffers by it before the row is read, and a small shared file could otherwise
    declare a width whose zstd frames truly decode to GBs a row. A shard of T tokens holds T x width
    values as at least their planes' bytes / MAX_EXPANSION bytes; its size is checked by every reader
    before a row is read."""
    codec, layers, hidden = spec["codec"], len(spec["layer_ids"]), spec["target"]["hidden_size"]
    for s in shards:
        planes = encoded_size(codec, s.tokens, stored_width(spec))
        if planes > MAX_EXPANSION[codec] * s.bytes:
            raise ValueError(
                f"spec.target.hidden_size {hidden} x {layers} layer_ids is too wide for shard {s.path}: its "
                f"{s.tokens} tokens would decode to {planes} bytes, more than its {s.bytes} bytes can hold "
                f"({codec} decodes at most {MAX_EXPANSION[codec]} bytes a stored byte)"
            )


def spec_differences(a: dict, b: dict, ignore: frozenset[str] = frozenset(), prefix: str = "") -> list[str]:
    """'field: A -> B' for every leaf of two nested dicts that differs (dotted names in `ignore` skipped;
    long strings such as hashes shortened)."""
    short = lambda v: (v[:12] + "...") if isinstance(v, str) and len(v) > 16 else v  # noqa: E731
    out = []
    for key in sorted(set(a) | set(b)):
        name, x, y = f"{prefix}{key}", a.get(key), b.get(key)
        if name in ignore:
            continue
        if isinstance(x, dict) and isinstance(y, dict):
            out += spec_differences(x, y, ignore, f"{name}.")
        elif x != y:
            out.append(f"{name}: {short(x)} -> {short(y)}")
    return out
