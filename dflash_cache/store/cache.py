"""Reading a finished cache: `open_cache(path)` and random access by sample id."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.codecs import decode, decompress, encoded_size
from dflash_cache.store.manifest import read_manifest
from dflash_cache.store.shard import ShardReader, ShardRecord, StoredRow


@dataclass
class CachedSample:
    sample_id: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    target_ids: torch.Tensor  # int64 [T]
    hidden: torch.Tensor  # bf16 [T, L*H]
    topk_ids: torch.Tensor | None = None  # int64 [T, K]
    topk_logprobs: torch.Tensor | None = None  # fp32 [T, K]


class Cache:
    """A complete cache. Opening reads only the manifest; rows are read one record batch at a time."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        self.spec: dict = self.manifest["spec"]
        self.shards: list[ShardRecord] = self.manifest["shards"]
        self.codec: str = self.spec["codec"]
        self.width: int = len(self.spec["layer_ids"]) * self.spec["target"]["hidden_size"]
        self._where: dict[int, tuple[int, int]] = {}
        self._lengths: dict[int, int] = {}
        for s, shard in enumerate(self.shards):
            for r, (sid, n) in enumerate(zip(shard.sample_ids, shard.num_tokens)):
                if sid in self._where:
                    raise DFlashCacheError(f"{self.root}: sample {sid} appears in two shards")
                self._where[sid] = (s, r)
                self._lengths[sid] = n
        self._readers: dict[int, ShardReader] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self):
        return iter(self._where)

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._where

    def lengths(self) -> dict[int, int]:
        """Tokens per sample id, from the manifest alone."""
        return self._lengths

    def _reader(self, shard_index: int) -> ShardReader:
        with self._lock:
            reader = self._readers.get(shard_index)
            if reader is None:
                path = self.root / self.shards[shard_index].path
                if not path.is_file():
                    raise DFlashCacheError(f"{path}: shard listed in the manifest is missing")
                reader = self._readers[shard_index] = ShardReader(path)
            return reader

    def read_stored(self, sample_id: int) -> StoredRow:
        """The row as stored (compressed), checksum verified. Safe to call from several threads."""
        if sample_id not in self._where:
            raise KeyError(sample_id)
        s, r = self._where[sample_id]
        row = self._reader(s).row(r)
        path = self.root / self.shards[s].path
        if row.sample_id != sample_id:
            raise DFlashCacheError(f"{path}: row {r} holds sample {row.sample_id}, the manifest says {sample_id}")
        if not row.check():
            raise DFlashCacheError(f"{path}: row {r} (sample {sample_id}) fails its checksum")
        return row

    def decode_planes(self, row: StoredRow) -> tuple[np.ndarray, torch.Tensor | None]:
        """Decompress a stored row's hidden payload: (uint8 planes, fp32 scales or None)."""
        n = len(row.input_ids)
        planes = decompress(row.hidden, self.codec, encoded_size(self.codec, n, self.width))
        scales = None
        if row.hidden_scales is not None:
            scales = torch.from_numpy(np.frombuffer(row.hidden_scales, dtype=np.float32).copy()).reshape(n, -1)
        return planes, scales

    def __getitem__(self, sample_id: int) -> CachedSample:
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
        )

    def close(self) -> None:
        with self._lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()


def open_cache(path: str | Path) -> Cache:
    return Cache(path)
