"""Reading a finished cache: `open_cache(path)` and random access by sample id or record id.

`cache[key]` takes two kinds of key. An integer is a sample id: the record's number among all
records of the --data files, in order, from 0 (data/dataset.py). A string is a record id: the
record's own `id` field (an integer id as its decimal digits, so cache["42"] is the record whose id is
42 or "42"). Ids are kept as the data has them and need not be unique: an id that several records
share (merged datasets that both number from 0) names no sample, and looking it up is an error that
lists the sample ids holding it. A key of neither kind is an error saying which keys exist.

The cache may be a local folder or an fsspec URL (`s3://bucket/prefix`). A remote shard is read by
byte ranges (its footer once, then one record batch per row), or, given `local_dir`, fetched whole
into that folder (bounded by `local_bytes`) and read from there.

Every row's checksum is verified as it is read. With `verify_shards` (training), each shard's
sha256 is verified too, once per Cache, by the first thread that reads from it (other threads
wanting the same shard wait for it): a shard swapped for another cache's, whose rows are all
sound, is caught there. A remote shard read by byte ranges is never whole on this machine and has
its rows' checksums only; a fetched one is verified as it is downloaded.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.codecs import decode, decompress, encoded_size, stored_width
from dflash_cache.store.fetch import ShardFetcher
from dflash_cache.store.manifest import read_manifest, read_remote_manifest
from dflash_cache.store.paths import check_file_name, inside
from dflash_cache.store.pool import ShardPool
from dflash_cache.store.reader import ShardReader, StoredRow
from dflash_cache.store.remote import RangeFile, RemoteDir, is_remote, local_path
from dflash_cache.store.shard import SHARD_DIR, ShardRecord

if TYPE_CHECKING:
    import torch

TARGET_DIR = "target"


class UnknownSample(DFlashCacheError, KeyError):
    """A key that names no sample of the cache (a KeyError, so `except KeyError` still catches it)."""

    __str__ = Exception.__str__  # KeyError's would print the message in quotes


@dataclass
class CachedSample:
    sample_id: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    target_ids: torch.Tensor  # int64 [T]
    hidden: torch.Tensor  # bf16 [T, L*H]
    topk_ids: torch.Tensor | None = None  # int64 [T, K]
    topk_logprobs: torch.Tensor | None = None  # fp32 [T, K]
    record_id: str | None = None  # the record's own `id`, as text


class Cache:
    """A complete cache. Opening reads only the manifest; rows are read one record batch at a time."""

    def __init__(
        self,
        root: str | Path,
        local_dir: str | Path | None = None,
        local_bytes: int | None = None,
        pool: ShardPool | None = None,
        verify_shards: bool = False,
        manifest: dict | None = None,
    ):
        """`pool`: the open shard readers, shared between caches read together (default: one of its own);
        `verify_shards`: each shard's sha256 is verified on first read (see above); `manifest`: what to
        read instead of manifest.json (a cache followed while it is written: its committed shards so far,
        stream/follow.py), its shards then added by `add_shards`."""
        self.remote = RemoteDir(str(root)) if is_remote(root) else None
        self.root: Path | str = self.remote.url if self.remote else local_path(root)
        if manifest is None:
            manifest = read_remote_manifest(self.remote) if self.remote else read_manifest(self.root)
        self.manifest = manifest
        self.spec: dict = self.manifest["spec"]
        self.shards: list[ShardRecord] = []
        self.codec: str = self.spec["codec"]
        self.width: int = stored_width(self.spec)  # values a token's stored tensor decodes to
        self._where: dict[int, tuple[int, int]] = {}
        self._lengths: dict[int, int] = {}
        self._by_record: dict[str, int | list[int]] | None = None  # built on first use: training needs none
        self.add_shards(self.manifest["shards"])
        self._own_pool = pool is None
        self._pool = ShardPool() if pool is None else pool
        self._fetcher = None
        if self.remote is not None and local_dir is not None:
            self._fetcher = ShardFetcher(self.remote, local_dir, local_bytes, on_evict=self._forget)
        self._target_dir: Path | None = None
        self._verify = verify_shards and (self.remote is None or self._fetcher is not None)
        self._verified: set[int] = set()
        self._verify_gates: dict[int, threading.Lock] = {}
        self._gates_lock = threading.Lock()

    def add_shards(self, shards: list[ShardRecord]) -> None:
        """Index `shards` after those already read (all of them: a manifest's, or shards newly committed)."""
        for shard in shards:
            s = len(self.shards)
            self.shards.append(shard)
            for r, (sid, n) in enumerate(zip(shard.sample_ids, shard.num_tokens)):
                if sid in self._where:
                    raise DFlashCacheError(f"{self.root}: sample {sid} appears in two shards")
                self._where[sid] = (s, r)
                self._lengths[sid] = n
        self._by_record = None

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self):
        return iter(self._where)

    def __contains__(self, key: int | str) -> bool:
        if isinstance(key, str):
            return isinstance(self._record_index().get(key), int)
        return isinstance(key, (int, np.integer)) and not isinstance(key, bool) and int(key) in self._where

    def sample_id(self, key: int | str) -> int:
        """The sample id a key names: an integer is one, a string is a record id (see above)."""
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            if int(key) in self._where:
                return int(key)
            hint = f" (there is a record id '{key}': give it as a string)" if str(key) in self._record_index() else ""
            raise UnknownSample(f"no sample {key} in {self.root}{hint}: {self._keys()}")
        if isinstance(key, str):
            holders = self._record_index().get(key)
            if isinstance(holders, int):
                return holders
            if holders:
                listed = ", ".join(map(str, holders[:5])) + (", ..." if len(holders) > 5 else "")
                raise UnknownSample(
                    f"record id {key!r} is the id of {len(holders)} records of {self.root} (sample ids "
                    f"{listed}); look one up by its sample id"
                )
            hint = (
                f" (there is a sample id {key}: give it as an integer)"
                if key.isdigit() and int(key) in self._where
                else ""
            )
            raise UnknownSample(f"no record id {key!r} in {self.root}{hint}: {self._keys()}")
        raise UnknownSample(f"{key!r} is not a key of {self.root}: {self._keys()}")

    def _keys(self) -> str:
        """What keys this cache has, for messages."""
        ids = sorted(self._where)
        numbers = (
            f"integer sample ids {ids[0]}..{ids[-1]}"
            + (f" ({len(ids):,} of them)" if len(ids) != ids[-1] - ids[0] + 1 else "")
            if ids
            else "no samples"
        )
        index = self._record_index()
        if not index:
            return f"keys are {numbers} (the records' numbers in the --data files, from 0); it has no record ids"
        return (
            f"keys are {numbers} (the records' numbers in the --data files, from 0) and {len(index):,} "
            f"record ids (the records' own `id`, as strings, e.g. {next(iter(index))!r})"
        )

    def _record_index(self) -> dict[str, int | list[int]]:
        """Record id -> its sample id, or the sample ids of the records that share it; in sample id order."""
        if self._by_record is None:
            index: dict[str, int | list[int]] = {}
            pairs = (
                pair for shard in self.shards for pair in zip(shard.sample_ids, shard.record_ids) if pair[1] is not None
            )
            for sid, record_id in sorted(pairs):
                held = index.setdefault(record_id, sid)
                if isinstance(held, list):
                    held.append(sid)
                elif held != sid:
                    index[record_id] = [held, sid]
            self._by_record = index  # built whole, then published: threads racing here build the same
        return self._by_record

    def record_id(self, sample_id: int) -> str | None:
        """The record's own `id` of a sample (None: it had none)."""
        s, r = self._where[sample_id]
        record_ids = self.shards[s].record_ids
        return record_ids[r] if record_ids else None

    def record_ids(self) -> dict[str, int | list[int]]:
        """Every record id, with the sample id it names (a list of them for an id several records share)."""
        return {key: list(held) if isinstance(held, list) else held for key, held in self._record_index().items()}

    def lengths(self) -> dict[int, int]:
        """Tokens per sample id, from the manifest alone."""
        return self._lengths

    def shard_name(self, shard_index: int) -> str:
        """The shard's path or URL, for messages."""
        return f"{self.root}/{self.shards[shard_index].path}"

    def _open_shard(self, shard_index: int) -> ShardReader:
        shard = self.shards[shard_index]
        if self.remote is None:
            path = inside(self.root, self.root / shard.path)
            if not path.is_file():
                raise DFlashCacheError(f"{path}: shard listed in the manifest is missing")
            if (size := path.stat().st_size) != shard.bytes:  # else a cut shard reads as "not an Arrow file"
                raise cut_shard_error(path, size, shard.bytes)
            return ShardReader(path)
        try:
            if self._fetcher is not None:
                return self._fetcher.open(shard)
            return ShardReader(self.shard_name(shard_index), RangeFile(self.remote, shard.path, shard.bytes))
        except FileNotFoundError:
            raise DFlashCacheError(f"{self.shard_name(shard_index)}: shard listed in the manifest is missing") from None

    def check_shards(self) -> None:
        """Every shard is there with the size the manifest gives it (one listing for a remote cache)."""
        if self.remote is not None:
            sizes = self.remote.sizes(SHARD_DIR)
        for index, shard in enumerate(self.shards):
            if self.remote is None:
                path = inside(self.root, self.root / shard.path)
                size = path.stat().st_size if path.is_file() else None
            else:
                size = sizes.get(shard.path.split("/", 1)[1])
            if size is None:
                raise DFlashCacheError(f"{self.shard_name(index)}: shard listed in the manifest is missing")
            if size != shard.bytes:
                raise cut_shard_error(self.shard_name(index), size, shard.bytes)

    def _verify_once(self, shard_index: int, reader: ShardReader) -> None:
        """sha256 of the shard's local file against the manifest, the first time a thread reads it,
        through `reader`'s own open file (the pool bounds the files open)."""
        with self._gates_lock:
            gate = self._verify_gates.setdefault(shard_index, threading.Lock())
        with gate:
            if shard_index in self._verified:
                return
            shard = self.shards[shard_index]
            fetched = self._fetcher is not None and self._fetcher.checked(shard.path)  # hashed as it was downloaded
            if not fetched and reader.sha256() != shard.sha256:
                if self._fetcher is not None:
                    raise DFlashCacheError(
                        f"{self._fetcher.root / shard.path}: sha256 does not match the manifest "
                        "(the local copy was replaced or damaged); delete it to fetch it again"
                    )
                raise DFlashCacheError(
                    f"{self.shard_name(shard_index)}: sha256 does not match the manifest (the shard "
                    f"was replaced or damaged); `dflash-cache verify {self.root}` checks every shard"
                )
            self._verified.add(shard_index)

    def _forget(self, shard_path: str) -> None:
        """Drop the reader of a shard the local folder evicted (closed once no thread reads it)."""
        self._pool.forget(lambda key: key[0] is self and self.shards[key[1]].path == shard_path)

    @contextmanager
    def local_copy(self, shard_index: int) -> Iterator[Path]:
        """A local file of the whole shard: the shard itself, or a temporary download of a remote one."""
        if self.remote is None:
            yield inside(self.root, self.root / self.shards[shard_index].path)
            return
        with tempfile.TemporaryDirectory(prefix="dflash-cache-shard-") as tmp:
            local = Path(tmp) / "shard.arrow"
            try:
                self.remote.download(self.shards[shard_index].path, local)
            except FileNotFoundError:
                raise DFlashCacheError(
                    f"{self.shard_name(shard_index)}: shard listed in the manifest is missing"
                ) from None
            yield local

    def target_dir(self) -> Path:
        """A local folder holding the cache's target/ files (downloaded once from a remote cache)."""
        if self.remote is None:
            return self.root / TARGET_DIR
        if self._target_dir is None:
            if self._fetcher is not None:
                folder = self._fetcher.root / TARGET_DIR
                folder.mkdir(exist_ok=True)
            else:
                folder = Path(tempfile.mkdtemp(prefix="dflash-cache-target-"))
                weakref.finalize(self, shutil.rmtree, folder, ignore_errors=True)
            for name in self.remote.list(TARGET_DIR):
                check_file_name(name, self.remote.url_of(TARGET_DIR))
                rel = f"{TARGET_DIR}/{name}"
                local = folder / name
                if not (local.is_file() and local.stat().st_size == self.remote.size(rel)):
                    self.remote.download(rel, local)
            self._target_dir = folder
        return self._target_dir

    def location(self, key: int | str) -> tuple[int, int]:
        """(shard index, row) of a sample."""
        return self._where[self.sample_id(key)]

    def read_stored(self, key: int | str) -> StoredRow:
        """The row as stored (compressed), checksum verified. Safe to call from several threads."""
        sample_id = self.sample_id(key)
        s, r = self._where[sample_id]
        with self._pool.reader((self, s), lambda: self._open_shard(s)) as reader:
            if self._verify and s not in self._verified:
                self._verify_once(s, reader)
            row = reader.row(r)  # its buffers stay valid after the pool closes the shard
        path = self.shard_name(s)
        if row.sample_id != sample_id:
            raise DFlashCacheError(f"{path}: row {r} holds sample {row.sample_id}, the manifest says {sample_id}")
        if not row.check():
            raise DFlashCacheError(f"{path}: row {r} (sample {sample_id}) fails its checksum")
        if len(row.input_ids) != self._lengths[sample_id]:  # the width was checked against the manifest's counts
            raise DFlashCacheError(
                f"{path}: row {r} holds {len(row.input_ids)} tokens, the manifest says {self._lengths[sample_id]}"
            )
        if row.record_id != self.record_id(sample_id):
            raise DFlashCacheError(
                f"{path}: row {r} holds record id {row.record_id!r}, the manifest says {self.record_id(sample_id)!r}"
            )
        return row

    def decode_planes(self, row: StoredRow) -> tuple[np.ndarray, torch.Tensor | None]:
        """Decompress a stored row's hidden payload: (uint8 planes, fp32 scales or None)."""
        import torch  # here, not at the top: opening a cache (`inspect`) needs no torch

        n = len(row.input_ids)
        planes = decompress(row.hidden, self.codec, encoded_size(self.codec, n, self.width))
        scales = None
        if row.hidden_scales is not None:
            scales = torch.from_numpy(np.frombuffer(row.hidden_scales, dtype=np.float32).copy()).reshape(n, -1)
        return planes, scales

    def __getitem__(self, key: int | str) -> CachedSample:
        """The sample a key names: a sample id (int) or a record id (str); see the module's docstring."""
        import torch

        sample_id = self.sample_id(key)
        row = self.read_stored(sample_id)
        planes, scales = self.decode_planes(row)
        n = len(row.input_ids)
        hidden = decode(torch.from_numpy(planes.copy()), scales, self.codec, n, self.width)
        k = None if row.topk_ids is None else len(row.topk_ids) // max(n, 1)
        return CachedSample(
            sample_id=sample_id,
            input_ids=torch.from_numpy(row.input_ids.astype(np.int64)),
            loss_mask=torch.from_numpy(row.loss_mask.copy()),
            target_ids=torch.from_numpy(row.target_ids.astype(np.int64)),
            hidden=hidden,
            topk_ids=None if k is None else torch.from_numpy(row.topk_ids.astype(np.int64)).reshape(n, k),
            topk_logprobs=None if k is None else torch.from_numpy(row.topk_logprobs.copy()).reshape(n, k),
            record_id=row.record_id,
        )

    def close(self) -> None:
        if self._own_pool:
            self._pool.close()
        else:
            self._pool.forget(lambda key: key[0] is self)


def open_cache(
    path: str | Path,
    local_dir: str | Path | None = None,
    local_bytes: int | None = None,
    pool: ShardPool | None = None,
    verify_shards: bool = False,
) -> Cache:
    """A cache at a local path, a `file://` URL or any fsspec URL (`s3://bucket/prefix`, `gs://...`)."""
    return Cache(path, local_dir, local_bytes, pool, verify_shards)


def cut_shard_error(name: str | Path, size: int, expected: int) -> DFlashCacheError:
    """A shard whose size is not the manifest's, as every reader names it."""
    return DFlashCacheError(f"{name}: {size} bytes, the manifest says {expected} (truncated or replaced)")
