"""The disk a cache will take, told before the first forward: a 20-hour extraction that fills its
disk halfway through is the failure this prevents."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from dflash_cache.console.units import size
from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.codecs import encoded_size, scale_columns, stored_width
from dflash_cache.store.subspace import inner_codec

# Stored payload bytes / encoded plane bytes, for the codecs whose payload goes through zstd, on
# activation-like states (benchmarks/codecs.py: bf16-zstd keeps 0.69 of raw bf16, fp8-zstd 0.84 of
# its e4m3 bytes, fp4-zstd 0.98 of its codes and scales). Real states compress a few points either
# side; the figure is an estimate, said as one.
ZSTD_SHARE = {"bf16-zstd": 0.69, "fp8-zstd": 0.84, "fp4-zstd": 0.98}
ROW_BYTES_PER_TOKEN = 4 + 1 + 4  # input_ids, loss_mask, target_ids
TOPK_BYTES = 4 + 4  # one top-K id and its log-probability


def bytes_per_token(spec: dict) -> float:
    """About the bytes one token takes in a cache of `spec`: its hidden payload, scales and row columns."""
    planes = encoded_size(spec["codec"], 1, stored_width(spec)) * ZSTD_SHARE.get(inner_codec(spec["codec"]), 1.0)
    return planes + 4 * scale_columns(spec) + ROW_BYTES_PER_TOKEN + TOPK_BYTES * spec.get("topk", 0)


@dataclass
class DiskNeed:
    tokens: int
    per_token: float
    free: int
    where: Path

    @property
    def bytes(self) -> int:
        return int(self.tokens * self.per_token)

    def describe(self, codec: str) -> str:
        return (
            f"the cache will take about {size(self.bytes)} ({self.tokens:,} tokens x {self.per_token:,.0f} bytes "
            f"a token with {codec}); {size(self.free)} free at {self.where}"
        )


def disk_need(root: Path, tokens: int, spec: dict) -> DiskNeed:
    """What `tokens` more tokens of a cache of `spec` take, and the space free where `root` lies."""
    where = Path(root)
    while not where.exists():  # a folder not made yet: the file system of its nearest parent
        where = where.parent
    return DiskNeed(tokens, bytes_per_token(spec), shutil.disk_usage(where).free, Path(root))


def check_disk(need: DiskNeed, codec: str) -> None:
    if need.bytes > need.free:
        raise DFlashCacheError(
            f"{need.describe(codec)}: not enough. Free space, use a smaller --codec (fp4, subspace-*), "
            "or pass --skip-disk-check if the estimate is wrong for this data"
        )
