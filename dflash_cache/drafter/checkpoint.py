"""Drafter weights and config on disk: `drafter.safetensors` + `drafter_config.json` in a directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.config_file import config_from_file
from dflash_cache.drafter.head import TargetHead
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.errors import JSON_FILE_ERRORS, DFlashCacheError, first_line
from dflash_cache.files.safetensors_file import save_tensors

WEIGHTS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter_config.json"


def save_drafter(model: DFlashDrafter, directory: str | Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    """The drafter's own parameters only (the target head is not part of them); `weights` in place of
    its state dict (a training run's fp32 masters)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = model.state_dict() if weights is None else weights
    state = {name: t.detach().contiguous().cpu() for name, t in weights.items()}
    save_tensors(state, directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")


def load_drafter_state(directory: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    directory = Path(directory)
    if not (directory / WEIGHTS_FILE).is_file() or not (directory / CONFIG_FILE).is_file():
        raise DFlashCacheError(f"{directory} is not a drafter checkpoint (it needs {WEIGHTS_FILE} and {CONFIG_FILE}).")
    try:
        values = json.loads((directory / CONFIG_FILE).read_text())
    except JSON_FILE_ERRORS as e:
        raise DFlashCacheError(f"{directory / CONFIG_FILE}: unreadable ({first_line(e)})") from None
    config = config_from_file(values, directory / CONFIG_FILE)
    return config, read_weights(directory / WEIGHTS_FILE, config, directory / CONFIG_FILE)


def read_weights(path: Path, config: DrafterConfig, config_path: Path) -> dict[str, torch.Tensor]:
    """A drafter's weights file, its tensors checked against `config` before any model is built: a
    shared file whose header lies, or a config whose sizes its tensors do not have (a huge
    intermediate size would otherwise be allocated first), is one line naming both files."""
    try:
        state = load_file(path)
    except (SafetensorError, OSError) as e:
        raise DFlashCacheError(f"{path}: unreadable safetensors file ({first_line(e)})") from None
    with torch.device("meta"):  # the shapes the config makes, without allocating them
        expected = {name: tuple(t.shape) for name, t in DFlashDrafter(config).state_dict().items()}
    problems = [f"{name} is missing" for name in expected if name not in state]
    problems += [f"{name} is not a weight of this drafter" for name in state if name not in expected]
    problems += [
        f"{name} is {list(t.shape)}, the config makes it {list(expected[name])}"
        for name, t in state.items()
        if name in expected and tuple(t.shape) != expected[name]
    ]
    problems += [f"{name} is {t.dtype}, not floating point" for name, t in state.items() if not t.is_floating_point()]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise DFlashCacheError(f"{path} does not fit {config_path}: {'; '.join(problems[:3])}{more}")
    return state


def load_drafter(directory: str | Path, head: TargetHead | None = None, **model_kwargs) -> DFlashDrafter:
    config, state = load_drafter_state(directory)
    model = DFlashDrafter(config, head, **model_kwargs)
    model.to(next(iter(state.values())).dtype)
    model.load_state_dict(state)
    return model
