"""Drafter weights and config on disk: `drafter.safetensors` + `drafter_config.json` in a directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash_cache.safetensors_file import save_tensors
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.head import TargetHead
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.errors import DFlashCacheError

WEIGHTS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter_config.json"


def save_drafter(model: DFlashDrafter, directory: str | Path) -> None:
    """The drafter's own parameters only (the target head is not part of them)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    save_tensors(state, directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")


def load_drafter_state(directory: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    directory = Path(directory)
    if not (directory / WEIGHTS_FILE).is_file() or not (directory / CONFIG_FILE).is_file():
        raise DFlashCacheError(f"{directory} is not a drafter checkpoint (it needs {WEIGHTS_FILE} and {CONFIG_FILE}).")
    config = DrafterConfig.from_dict(json.loads((directory / CONFIG_FILE).read_text()))
    return config, load_file(directory / WEIGHTS_FILE)


def load_drafter(directory: str | Path, head: TargetHead | None = None, **model_kwargs) -> DFlashDrafter:
    config, state = load_drafter_state(directory)
    model = DFlashDrafter(config, head, **model_kwargs)
    model.to(next(iter(state.values())).dtype)
    model.load_state_dict(state)
    return model
