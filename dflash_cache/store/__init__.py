from dflash_cache.store.cache import Cache, CachedSample, open_cache
from dflash_cache.store.codecs import CODECS

__all__ = ["CODECS", "Cache", "CachedSample", "open_cache"]
