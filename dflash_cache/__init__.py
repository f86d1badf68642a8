"""dflash-cache: extract a target model's hidden states once, train DFlash drafters from the cache."""

from dflash_cache.batch import FeatureBatch
from dflash_cache.errors import DFlashCacheError
from dflash_cache.store import Cache, open_cache

__all__ = ["Cache", "DFlashCacheError", "FeatureBatch", "open_cache"]
__version__ = "0.1.0"
