"""`verify`: re-read every shard of a cache and check every byte that the manifest vouches for."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.cache import Cache
from dflash_cache.store.codecs import decode
from dflash_cache.store.shard import ShardReader

import torch


@dataclass
class VerifyReport:
    shards: int
    rows: int
    tokens: int
    bytes: int


def _sha256(path, chunk: int = 8 << 20) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
    return sha.hexdigest()


def verify_cache(cache: Cache, progress: Callable[[int], None] = lambda n: None) -> VerifyReport:
    """Raises DFlashCacheError naming the first bad shard (and row); `progress` gets bytes checked."""
    rows = tokens = 0
    for shard in cache.shards:
        path = cache.root / shard.path
        if not path.is_file():
            raise DFlashCacheError(f"{path}: shard listed in the manifest is missing")
        if path.stat().st_size != shard.bytes:
            raise DFlashCacheError(f"{path}: {path.stat().st_size} bytes, the manifest says {shard.bytes} (truncated or replaced)")
        if _sha256(path) != shard.sha256:
            raise DFlashCacheError(f"{path}: sha256 does not match the manifest")
        reader = ShardReader(path)
        try:
            if reader.num_rows != shard.rows:
                raise DFlashCacheError(f"{path}: {reader.num_rows} rows, the manifest says {shard.rows}")
            for r, (sid, n) in enumerate(zip(shard.sample_ids, shard.num_tokens)):
                row = reader.row(r)
                where = f"{path}: row {r} (sample {sid})"
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
        progress(shard.bytes)
    return VerifyReport(shards=len(cache.shards), rows=rows, tokens=tokens, bytes=sum(s.bytes for s in cache.shards))
