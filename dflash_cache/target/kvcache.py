"""The target's KV cache through transformers' public cache API, whichever release is installed.

A forward takes its cache as `cache=` in newer transformers and as `past_key_values=` in older ones
(which newer ones still take, with a deprecation warning): the name is read from the forward's
signature, never from a version number. A cache can be cut back to an earlier length (speculative
decoding's rejected drafts) only where every layer is plain attention; the recurrent state of
linear-attention layers cannot drop tokens without snapshots of it, which are not kept.
"""

from __future__ import annotations

import inspect

from torch import nn
from transformers import Cache, DynamicCache

CROPPABLE_LAYERS = ("full_attention",)


def cache_kwargs(module: nn.Module, cache: Cache | None) -> dict:
    """The keyword arguments that hand `cache` to `module`'s forward (None: no cache)."""
    if cache is None:
        return {"use_cache": False}
    name = "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def returned_cache(output) -> Cache:
    """The cache a forward with use_cache=True returned, under either name."""
    return next(output[name] for name in ("cache", "past_key_values") if name in output)


def croppable(config) -> bool:
    """Whether a target with this text config keeps a cache that `crop_cache` can cut back."""
    layer_types = getattr(config, "layer_types", None) or CROPPABLE_LAYERS
    return all(kind in CROPPABLE_LAYERS for kind in layer_types)


def new_cache(model: nn.Module) -> DynamicCache:
    return DynamicCache(config=model.config)


def crop_cache(cache: Cache, tokens: int) -> None:
    """Drop the newest `tokens` positions (0: none; older releases read crop(0) as "keep none")."""
    if tokens:
        cache.crop(-tokens)
