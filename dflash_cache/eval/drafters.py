"""Load a drafter to evaluate from any of the folders that hold one.

RUN/checkpoints/step-N/   a training checkpoint: drafter.safetensors + drafter_config.json
RUN/                      a training run: its newest complete checkpoint
OUT/                      an export (`dflash-cache export`): config.json + model.safetensors
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from dflash_cache.drafter.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    load_drafter_state,
    read_weights,
)
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.head import TargetHead
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.errors import JSON_FILE_ERRORS, DFlashCacheError
from dflash_cache.target.precision import forward_dtype
from dflash_cache.train.checkpoint import CHECKPOINT_DIR, latest_checkpoint
from dflash_cache.train.rundir import RUN_FILE

EXPORT_CONFIG, EXPORT_WEIGHTS = "config.json", "model.safetensors"
T = TypeVar("T")


def checkpoint_of(path: str | Path) -> Path:
    """A training run folder's newest complete checkpoint; any other path as it is."""
    path = Path(path)
    if not path.exists():
        raise DFlashCacheError(f"{path} does not exist; pass a training run, one of its checkpoints, or an export")
    if (path / CHECKPOINT_DIR).is_dir() and not (path / WEIGHTS_FILE).is_file():
        checkpoint = latest_checkpoint(path)
        if checkpoint is None:
            raise DFlashCacheError(f"{path} is a training run without a complete checkpoint yet.")
        return checkpoint
    return path


def from_newest(path: str | Path, read: Callable[[Path], T]) -> T:
    """`read(checkpoint_of(path))`. When `path` is a run still training, the checkpoint chosen may be
    deleted while it is read (`--keep-last` keeps the newest few): then the newest is chosen again."""
    for _ in range(3):
        chosen = checkpoint_of(path)
        try:
            return read(chosen)
        except (DFlashCacheError, OSError):
            if chosen == Path(path) or chosen.exists():
                raise
    raise DFlashCacheError(f"{path}: its newest checkpoint was deleted while being read, three times; try again")


def read_drafter(path: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor], Path]:
    """(config, weights, the folder they came from)."""
    return from_newest(path, _read_drafter)


def _read_drafter(path: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor], Path]:
    if (path / WEIGHTS_FILE).is_file() and (path / CONFIG_FILE).is_file():
        config, state = load_drafter_state(path)
        return config, state, path
    if (path / EXPORT_WEIGHTS).is_file() and (path / EXPORT_CONFIG).is_file():
        config = load_drafter_config(path / EXPORT_CONFIG)
        return config, read_weights(path / EXPORT_WEIGHTS, config, path / EXPORT_CONFIG), path
    raise DFlashCacheError(
        f"{path} holds no drafter: pass a training checkpoint (RUN/checkpoints/step-N, with {WEIGHTS_FILE}), "
        f"a training run folder, or an export (with {EXPORT_WEIGHTS} and {EXPORT_CONFIG})."
    )


def training_run(source: Path) -> Path | None:
    """The run folder of a drafter read from `source` (a checkpoint of it), or None (an export)."""
    source = Path(source)
    run = source.parent.parent
    return run if source.parent.name == CHECKPOINT_DIR and (run / RUN_FILE).is_file() else None


def _run_file(run: Path) -> dict:
    try:
        values = json.loads((run / RUN_FILE).read_text())
    except JSON_FILE_ERRORS as e:
        raise DFlashCacheError(
            f"{run / RUN_FILE}: unreadable ({e}); pass --eval-fraction and the other options"
        ) from None
    if not isinstance(values, dict):
        raise DFlashCacheError(f"{run / RUN_FILE} is not a JSON object; pass --eval-fraction and the other options")
    return values


def run_options(run: Path) -> dict:
    """The training options a run recorded (eval_fraction, seed, token_budget, max_anchors, gamma, labels...)."""
    options = _run_file(run).get("options")
    return options if isinstance(options, dict) else {}


def run_caches(run: Path) -> list:
    """The specs of the caches a run trained on."""
    return _run_file(run).get("cache_specs", [])


def check_fits(
    config: DrafterConfig, hidden_size: int, vocab_size: int, num_layers: int, layer_ids: list[int] | None = None
) -> None:
    """The drafter must read this target: same hidden size and vocabulary, layers it has (or the cache holds)."""
    problems = []
    if config.hidden_size != hidden_size:
        problems.append(f"hidden size {config.hidden_size} vs the target's {hidden_size}")
    if config.vocab_size != vocab_size:
        problems.append(f"vocabulary {config.vocab_size} vs the target's {vocab_size}")
    if max(config.target_layer_ids) >= num_layers:
        problems.append(f"target layers {config.target_layer_ids} vs the target's {num_layers} layers")
    if layer_ids is not None and list(layer_ids) != list(config.target_layer_ids):
        problems.append(f"target layers {config.target_layer_ids} vs the cache's {list(layer_ids)}")
    if problems:
        raise DFlashCacheError("the drafter was not trained for this target: " + "; ".join(problems) + ".")


def build_drafter(
    config: DrafterConfig,
    state: dict[str, torch.Tensor],
    head: TargetHead,
    device: torch.device | str,
    attention: str = "flex",
) -> DFlashDrafter:
    """The drafter in fp32 on `device` (it runs under `drafter_autocast`, as in training), with `head`; built
    there, so that its random initialisation, which the checkpoint overwrites, costs no host minute."""
    with torch.device(device):
        model = DFlashDrafter(config, attention=attention)
    model.load_state_dict({name: t.float() for name, t in state.items()})
    model.head = head.to(forward_dtype(device))
    return model.to(device).eval().requires_grad_(False)  # the head too
