"""A set of row numbers 0..n-1 held as bits: one bit a row where a sorted int64 array costs 64.

What a starting extraction rank must know of every sample (is it committed already; is it in the
plan exactly once) without holding 8 bytes a sample of the whole dataset.
"""

from __future__ import annotations

import numpy as np

CHUNK = 1 << 16  # rows handled at once by passes over n rows: tens of bytes a row for a moment (~3 MB)


class RowBits:
    def __init__(self, n: int):
        self.n = n
        self.bits = np.zeros((n + 7) // 8, dtype=np.uint8)

    def add(self, rows: np.ndarray) -> np.ndarray:
        """Add `rows` (each in 0..n-1); returns which of them were not in the set before (a row
        given twice here counts as new once, at its first place)."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.n):
            raise ValueError(f"a row outside 0..{self.n - 1}")
        new = ~self.has(rows)
        _, first = np.unique(rows, return_index=True)
        once = np.zeros(len(rows), dtype=bool)
        once[first] = True
        new &= once
        np.bitwise_or.at(self.bits, rows[new] >> 3, (1 << (rows[new] & 7)).astype(np.uint8))
        return new

    def has(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        return (self.bits[rows >> 3] >> (rows & 7).astype(np.uint8)) & 1 == 1

    def count(self) -> int:
        return sum(int(np.unpackbits(self.bits[i : i + CHUNK]).sum()) for i in range(0, len(self.bits), CHUNK))

    def total(self, values: np.ndarray) -> int:
        """The sum of `values[row]` over the rows in the set (`values` of length n; a memory map is
        read a chunk at a time)."""
        out = 0
        for start in range(0, self.n, CHUNK):
            part = np.unpackbits(
                self.bits[start >> 3 : (start + CHUNK) >> 3], count=min(CHUNK, self.n - start), bitorder="little"
            ).astype(bool)
            out += int(np.asarray(values[start : start + CHUNK])[part].sum())
        return out
