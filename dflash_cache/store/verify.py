"""`verify`: re-read every shard of a cache and check every byte that the manifest vouches for: the
shards, the files of target/ and the journals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.cache import Cache, cut_shard_error
from dflash_cache.store.codecs import decode
from dflash_cache.store.integrity import check_journals, check_target_files
from dflash_cache.store.reader import ShardReader
from dflash_cache.store.shard import ShardRecord, file_sha256


@dataclass
class VerifyReport:
    shards: int
    rows: int
    tokens: int
    bytes: int


def verify_cache(cache: Cache, progress: Callable[[int], None] = lambda n: None) -> VerifyReport:
    """Raises DFlashCacheError naming the first bad shard (and row); `progress` gets bytes checked.
    A remote cache's shards are downloaded one at a time to a temporary file and checked there."""
    check_target_files(cache.target_dir(), cache.manifest)
    rows = tokens = 0
    for index, shard in enumerate(cache.shards):
        with cache.local_copy(index) as path:
            rows_, tokens_ = _verify_shard(cache, shard, path, cache.shard_name(index))
        rows, tokens = rows + rows_, tokens + tokens_
        progress(shard.bytes)
    check_journals(cache)
    return VerifyReport(shards=len(cache.shards), rows=rows, tokens=tokens, bytes=sum(s.bytes for s in cache.shards))


def _verify_shard(cache: Cache, shard: ShardRecord, path: Path, name: str) -> tuple[int, int]:
    """(rows, tokens) of a shard whose bytes are at `path`; `name` is its path or URL, for messages."""
    rows = tokens = 0
    if not path.is_file():
        raise DFlashCacheError(f"{name}: shard listed in the manifest is missing")
    if (size := path.stat().st_size) != shard.bytes:
        raise cut_shard_error(name, size, shard.bytes)
    if file_sha256(path) != shard.sha256:
        raise DFlashCacheError(f"{name}: sha256 does not match the manifest")
    reader = ShardReader(path)
    try:
        if reader.num_rows != shard.rows:
            raise DFlashCacheError(f"{name}: {reader.num_rows} rows, the manifest says {shard.rows}")
        for r, (sid, n) in enumerate(zip(shard.sample_ids, shard.num_tokens)):
            row = reader.row(r)
            where = f"{name}: row {r} (sample {sid})"
            if row.sample_id != sid or len(row.input_ids) != n:
                raise DFlashCacheError(f"{where}: does not match the manifest")
            if not row.check():
                raise DFlashCacheError(f"{where}: checksum mismatch")
            if len(row.loss_mask) != n or len(row.target_ids) != n:
                raise DFlashCacheError(f"{where}: column lengths differ")
            try:
                planes, scales = cache.decode_planes(row)
                hidden = decode(torch.from_numpy(planes.copy()), scales, cache.codec, n, cache.width)
            except DFlashCacheError as e:
                raise DFlashCacheError(f"{where}: {e}") from None
            if not torch.isfinite(hidden).all():
                raise DFlashCacheError(f"{where}: hidden states hold NaN or Inf")
            rows += 1
            tokens += n
    finally:
        reader.close()
    return rows, tokens
