"""`MemorySource`: batches already on the device, for measuring the stream against a memory-fed run."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from dflash_cache.stream.batch import FeatureBatch


class MemorySource:
    """Yields the given device batches in order, cycling through them for `length` batches."""

    def __init__(self, batches: Iterable[FeatureBatch], length: int | None = None):
        self.batches = list(batches)
        self.length = len(self.batches) if length is None else length

    def __iter__(self) -> Iterator[FeatureBatch]:
        for i in range(self.length):
            yield self.batches[i % len(self.batches)]

    def __len__(self) -> int:
        return self.length
