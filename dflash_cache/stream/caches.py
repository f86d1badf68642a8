"""Several caches read as one: the union of their samples, and the held-out split.

Inside the stream a sample is named by a *key*: its index in `CacheSet.entries`, which lists
(cache index, sample id) pairs cache by cache in sample-id order. Keys depend only on the list of
caches, so the plan built from them is the same on every rank and in every run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store import Cache, open_cache
from dflash_cache.store.manifest import spec_differences
from dflash_cache.store.pool import ShardPool
from dflash_cache.store.reader import StoredRow

# Spec fields that may differ between caches trained on together: where the samples came from and how
# they were batched.
FREE_SPEC_FIELDS = {
    "target.name",
    "data_hash",
    "max_length",
    "chat_template_kwargs",
    "token_budget",
    "batching",
    "format_version",
}


def is_held_out(sample_id: int, fraction: float) -> bool:
    """A stable pseudo-random choice by sample id alone: the same in every run and for every cache."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(str(sample_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


class CacheSet:
    """The union of one or more caches with the same spec (target, layers, codec, tokenizer)."""

    def __init__(
        self,
        paths: list[str | Path],
        local_dir: str | Path | None = None,
        local_bytes: int | None = None,
        max_open_shards: int | None = None,
        verify_shards: bool = False,
    ):
        """`paths`: folders or fsspec URLs; `local_dir`: where remote shards are fetched whole (see store.cache);
        `max_open_shards`: the most shards open at once, over all the caches (store.pool); `verify_shards`:
        whether each shard's sha256 is verified on first read (store.cache)."""
        if not paths:
            raise DFlashCacheError("no cache given: pass --cache CACHE")
        self.pool = ShardPool(max_open_shards)
        self.caches: list[Cache] = [open_cache(p, local_dir, local_bytes, self.pool, verify_shards) for p in paths]
        first = self.caches[0]
        for cache in self.caches[1:]:
            diff = spec_differences(first.spec, cache.spec, FREE_SPEC_FIELDS)
            if diff:
                raise DFlashCacheError(
                    f"caches {first.root} and {cache.root} have different specs ({'; '.join(diff)}); "
                    "only caches of the same target, layers, codec and tokenizer can be trained on together"
                )
        self.spec: dict = first.spec
        self.codec: str = first.codec
        self.width: int = first.width
        self.entries: list[tuple[int, int]] = []
        self.lengths: list[int] = []
        self._check_disjoint()
        for c, cache in enumerate(self.caches):
            lengths = cache.lengths()
            for sid in sorted(lengths):
                self.entries.append((c, sid))
                self.lengths.append(lengths[sid])

    def _check_disjoint(self) -> None:
        """Caches of one data source must not share sample ids: that would train on a sample twice."""
        seen: dict[tuple[str, int], int] = {}
        for c, cache in enumerate(self.caches):  # by position: the same folder given twice is two of them
            source = cache.spec.get("data_hash", "")
            for sid in cache.lengths():
                other = seen.setdefault((source, sid), c)
                if other != c:
                    raise DFlashCacheError(
                        f"sample {sid} is in both {self.caches[other].root} and {cache.root} "
                        "(same data source); give each cache once"
                    )

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def head_dir(self) -> Path:
        """The `target/` folder with head.safetensors (the same target for every cache of the set)."""
        return self.caches[0].target_dir()

    def sample_id(self, key: int) -> int:
        return self.entries[key][1]

    def describe(self, key: int) -> str:
        c, sid = self.entries[key]
        return f"sample {sid}" if len(self.caches) == 1 else f"sample {sid} of {self.caches[c].root}"

    def split(self, eval_fraction: float) -> tuple[list[int], list[int]]:
        """(train keys, held-out keys), chosen by sample id."""
        train, held_out = [], []
        for key, (_, sid) in enumerate(self.entries):
            (held_out if is_held_out(sid, eval_fraction) else train).append(key)
        return train, held_out

    def read_order(self, key: int) -> tuple[int, int, int]:
        """(cache, shard, row) of a key: reading a batch's rows in this order reads each shard's rows together."""
        c, sid = self.entries[key]
        return (c, *self.caches[c].location(sid))

    def read(self, key: int) -> StoredRow:
        c, sid = self.entries[key]
        return self.caches[c].read_stored(sid)

    def close(self) -> None:
        for cache in self.caches:
            cache.close()
        self.pool.close()
