"""Export a drafter checkpoint in the reference layout: `config.json` + `model.safetensors`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_cache.safetensors_file import save_tensors
from dflash_cache.drafter.checkpoint import load_drafter_state
from dflash_cache.drafter.reference import config_to_reference
from dflash_cache.choices import EXPORT_DTYPES
from dflash_cache.errors import DFlashCacheError

DTYPES = {name: getattr(torch, name) for name in EXPORT_DTYPES}


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Writes `out_dir/config.json` and `out_dir/model.safetensors`, loadable with
    `dflash.model.DFlashDraftModel.from_pretrained(out_dir)`. Returns `out_dir`."""
    if dtype not in DTYPES:
        raise DFlashCacheError(f"unknown export dtype {dtype!r}; use one of {list(DTYPES)}.")
    config, state = load_drafter_state(checkpoint_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(DTYPES[dtype]).contiguous() for name, t in state.items()}
    save_tensors(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config_to_reference(config, dtype), indent=2) + "\n")
    return out_dir
