"""dflash-cache: extract a target model's hidden states once, train DFlash drafters from the cache."""

from dflash_cache.errors import DFlashCacheError

__all__ = ["Cache", "DFlashCacheError", "FeatureBatch", "open_cache"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: every command imports this package, and most never need torch.
    if name == "FeatureBatch":
        from dflash_cache.stream.batch import FeatureBatch

        return FeatureBatch
    if name in ("Cache", "open_cache"):
        from dflash_cache import store

        return getattr(store, name)
    raise AttributeError(f"module 'dflash_cache' has no attribute {name!r}")
