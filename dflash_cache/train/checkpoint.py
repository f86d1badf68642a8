"""Checkpoints in `RUN/checkpoints/step-N/`, written atomically.

A checkpoint is written into `checkpoints/.step-N.tmp/`, every file fsynced, then `complete.json`
last, then the folder is renamed to `step-N`. Resume takes the newest `step-N` holding
`complete.json`; a folder without it (a crash mid-write, or anything else) is never picked up.

Contents: the drafter (`save_drafter`'s files, which `dflash-cache export` reads; fp32, the optimizer's
masters where the model holds bf16 working copies), and
`train_state.json` + `train_state.safetensors` (state_io.py: nothing is unpickled) with the
optimizer, the LR scheduler, the RNG states of every rank and the stream position (epoch, batch of
the epoch's plan) to continue from.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError

from dflash_cache.drafter.checkpoint import load_drafter_state, save_drafter
from dflash_cache.errors import DFlashCacheError, first_line
from dflash_cache.files import faults
from dflash_cache.files.write_errors import write_failed
from dflash_cache.store.shard import fsync_dir
from dflash_cache.train.optim import full_precision_weights, load_full_precision_weights
from dflash_cache.train.state_io import load_state, save_state

CHECKPOINT_DIR = "checkpoints"
TRAIN_STATE = "train_state"  # .json + .safetensors
COMPLETE = "complete.json"
_NAME = re.compile(r"step-(\d+)")
_DAMAGED = "the checkpoint is damaged: move its folder away to resume from the one before, or start a new run"


def rng_state() -> dict:
    """This process's RNG states, as tensors and plain values only."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


def save_checkpoint(
    run_dir: Path,
    step: int,
    drafter: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    position: dict,
    rng_states: list[dict],
) -> Path:
    """`position`: {"step", "epoch", "batch"}; `rng_states`: one per rank. Returns the folder."""
    root = Path(run_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    final = root / f"step-{step}"
    try:
        tmp.mkdir()
        save_drafter(drafter, tmp, full_precision_weights(drafter, optimizer))
        save_state(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "position": position,
                "rng": rng_states,
            },
            tmp,
            TRAIN_STATE,
        )
        faults.point("checkpoint.write")
        (tmp / COMPLETE).write_text(json.dumps({"step": step}) + "\n")
        _fsync_tree(tmp)
    except (OSError, SafetensorError) as e:  # a full disk: the half-written folder goes, the last complete one stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(
            final, root, e, "rerun the same train command with --resume to continue from the last complete checkpoint"
        ) from None
    if final.exists():  # a resumed run saving a step that an earlier attempt also saved
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    return final


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINT_DIR
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = _NAME.fullmatch(path.name)
            if match and (path / COMPLETE).is_file():
                found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint folder `step-N` holds."""
    return int(_NAME.fullmatch(Path(path).name).group(1))


def remove_partial(run_dir: Path) -> None:
    """Delete the temporary folders of checkpoints whose writing was interrupted."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if root.is_dir():
        for path in root.glob(".step-*.tmp"):
            shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: Path, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """Restores the drafter, optimizer and scheduler in place; returns {"position", "rng"}."""
    config, weights = load_drafter_state(path)
    if config.to_dict() != drafter.config.to_dict():
        raise DFlashCacheError(f"{path}: the checkpoint's drafter config differs from this run's")
    load_full_precision_weights(drafter, optimizer, weights)
    state = load_state(path, TRAIN_STATE)
    try:
        _check_optimizer_state(state["optimizer"], optimizer, drafter, path / f"{TRAIN_STATE}.safetensors")
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        return {"position": state["position"], "rng": state["rng"]}
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise DFlashCacheError(f"{path}: the training state does not fit this run ({first_line(e)})") from None


def _check_optimizer_state(
    saved: dict, optimizer: torch.optim.Optimizer, drafter: torch.nn.Module, where: Path
) -> None:
    """Each saved moment has its parameter's shape and only finite values: otherwise the first step
    failed on a shape naming no file, or its NaN loss was blamed on the data."""
    names = {p: name for name, p in drafter.named_parameters()}
    saved_ids = [i for group in saved["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for saved_id, p in zip(saved_ids, params):
        for key, value in saved["state"].get(saved_id, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            what = f"optimizer state {key} of {names.get(p, f'parameter {saved_id}')}"
            if key != "step" and value.shape != p.shape:
                raise DFlashCacheError(
                    f"{where}: {what} is {list(value.shape)}, the parameter is {list(p.shape)}; {_DAMAGED}"
                )
            if value.is_floating_point() and not torch.isfinite(value).all():
                raise DFlashCacheError(f"{where}: {what} holds non-finite values; {_DAMAGED}")
