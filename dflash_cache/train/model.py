"""The drafter a run trains: its config fitted to the source's target, and the frozen target head."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from dflash_cache.drafter.config import DrafterConfig, adapt_to_cache
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.defaults import TARGET, choose_mask_token, target_drafter_config
from dflash_cache.drafter.head import TargetHead
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.integrity import check_target_files
from dflash_cache.store.subspace import is_subspace
from dflash_cache.stream.caches import CacheSet
from dflash_cache.target.precision import forward_dtype

HEAD_FILE = "head.safetensors"


def tokenizer_mask_token(target_dir: Path) -> int | None:
    """The mask token id the cache's tokenizer declares, read from its files (no tokenizer loaded)."""
    try:
        name = json.loads((target_dir / "tokenizer_config.json").read_text()).get("mask_token")
        added = json.loads((target_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    except (OSError, json.JSONDecodeError):
        return None
    if isinstance(name, dict):
        name = name.get("content")
    return next((t["id"] for t in added if t.get("content") == name), None) if name else None


def drafter_config_for(name_or_path: str, spec: dict, tokenizer_dir: Path) -> tuple[DrafterConfig, list[str]]:
    """`_drafter_config_for`, its `fc` reading what the cache stores: the layers' states, or a subspace
    codec's coordinates."""
    config, notes = _drafter_config_for(name_or_path, spec, tokenizer_dir)
    rank = spec.get("subspace", {}).get("rank", 0) if is_subspace(spec.get("codec", "")) else 0
    if config.subspace_rank != rank:
        notes.append(f"subspace_rank: {config.subspace_rank} -> {rank} (the cache's {spec['codec']} coordinates)")
        config = replace(config, subspace_rank=rank)
    return config, notes


def _drafter_config_for(name_or_path: str, spec: dict, tokenizer_dir: Path) -> tuple[DrafterConfig, list[str]]:
    """The drafter config fitted to the target of a cache spec (`target`: the target's own shape; a preset
    adapts; a JSON file must already match), and one line per change. The mask token is the tokenizer's
    if it declares one; the target's own shape otherwise gets one chosen for it (`choose_mask_token`)."""
    mask = tokenizer_mask_token(tokenizer_dir)
    if str(name_or_path) == TARGET:
        if mask is not None:
            return target_drafter_config(tokenizer_dir, spec["layer_ids"], mask), []
        chosen = choose_mask_token(tokenizer_dir, spec["target"]["vocab_size"])
        name = f" {chosen.text!r}" if chosen.text else ""
        note = f"mask token {chosen.id}{name}: {chosen.why} (the tokenizer declares no mask token)"
        return target_drafter_config(tokenizer_dir, spec["layer_ids"], chosen.id, chosen.text), [note]
    config = load_drafter_config(name_or_path)
    return adapt_to_cache(
        config,
        target_hidden_size=spec["target"]["hidden_size"],
        vocab_size=spec["target"]["vocab_size"],
        mask_token_id=config.mask_token_id if mask is None else mask,
        layer_ids=spec["layer_ids"],
        num_target_layers=spec["target"]["num_layers"],
    )


def check_head(caches: CacheSet) -> Path:
    """The target head's path, once the target/ files match what the manifest lists."""
    path = caches.head_dir / HEAD_FILE
    if not path.is_file():
        raise DFlashCacheError(f"{path} is missing: the cache lacks the target head the drafter shares (rerun extract)")
    check_target_files(caches.head_dir, caches.caches[0].manifest)
    TargetHead.check_shapes(path, caches.spec["target"]["vocab_size"], caches.spec["target"]["hidden_size"])
    return path


def build_drafter(
    config: DrafterConfig, head: TargetHead, device: torch.device, seed: int, basis: torch.Tensor | None = None
) -> DFlashDrafter:
    """fp32 weights initialised from `seed` on `device` itself (the same on every rank), with the
    target head in the dtype the step computes in (target/precision.py); `basis`: a subspace cache's
    (config.subspace_rank > 0). Drawn on the host and copied over, a 27B drafter's 1.73 B weights took
    tens of seconds on a small CPU before the first step."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = DFlashDrafter(config)
    model.head = head.to(forward_dtype(device))
    if config.subspace_rank:
        if basis is None:
            raise DFlashCacheError("this drafter reads subspace coordinates: train it on a subspace-coded cache")
        model.subspace_basis.copy_(basis)
    return model
