"""Export a drafter checkpoint in the reference layout: `config.json` + `model.safetensors`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_cache.choices import EXPORT_DTYPES
from dflash_cache.drafter.checkpoint import load_drafter_state
from dflash_cache.drafter.reference import config_to_reference
from dflash_cache.errors import DFlashCacheError
from dflash_cache.files.folders import check_holds_only
from dflash_cache.files.safetensors_file import save_tensors
from dflash_cache.store.subspace import fold

DTYPES = {name: getattr(torch, name) for name in EXPORT_DTYPES}
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def check_export_out(out: Path) -> bool:
    """`export --out` must be new, empty, or an earlier export (replaced), never a folder (a cache, a
    training run) into which the two files would be mixed or over whose files they would be written.
    Raises otherwise; True when it holds an earlier export to replace."""
    out = Path(out)
    check_holds_only(out, (CONFIG_FILE, WEIGHTS_FILE), "--out", "an export's")
    return out.is_dir() and any(out.iterdir())


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Writes `out_dir/config.json` and `out_dir/model.safetensors`, loadable with
    `dflash.model.DFlashDraftModel.from_pretrained(out_dir)`. Returns `out_dir`."""
    if dtype not in DTYPES:
        raise DFlashCacheError(f"unknown export dtype {dtype!r}; use one of {list(DTYPES)}.")
    config, state = load_drafter_state(checkpoint_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if config.subspace_rank:  # the reference layout reads full states: fold the basis into fc
        state["fc.weight"] = fold(state["fc.weight"], state.pop("subspace_basis"))
    tensors = {name: t.to(DTYPES[dtype]).contiguous() for name, t in state.items()}
    save_tensors(tensors, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(config_to_reference(config, dtype), indent=2) + "\n")
    return out_dir
