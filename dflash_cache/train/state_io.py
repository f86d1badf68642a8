"""Nested training state (optimizer, scheduler, RNG, position) as `NAME.json` + `NAME.safetensors`,
so that resuming from a checkpoint someone else wrote runs no code: nothing is unpickled.

The JSON holds the structure: numbers, strings, booleans, null and lists as themselves, a tuple as
{"tuple": [...]}, a dict as {"dict": [[key, value], ...]} (keys are strings or integers), a tensor
as {"tensor": NAME}, NAME being its key in the safetensors file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash_cache.errors import JSON_FILE_ERRORS, DFlashCacheError


def save_state(state: object, directory: Path, name: str) -> None:
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: object) -> object:
        if isinstance(value, torch.Tensor):
            key = f"t{len(tensors)}"
            value = value.detach()
            # A copy either way: safetensors refuses tensors that share memory (views of one another).
            tensors[key] = (value.clone() if value.device.type == "cpu" else value.cpu()).contiguous()
            return {"tensor": key}
        if isinstance(value, dict):
            if not all(type(k) in (str, int) for k in value):
                raise TypeError(f"a dict key of type {type(next(k for k in value if type(k) not in (str, int)))}")
            return {"dict": [[k, encode(v)] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"tuple": [encode(v) for v in value]}
        if isinstance(value, list):
            return [encode(v) for v in value]
        if value is None or type(value) in (bool, int, float, str):
            return value
        raise TypeError(f"cannot store a {type(value).__name__} in the training state")

    structure = encode(state)
    save_file(tensors, Path(directory) / f"{name}.safetensors")
    (Path(directory) / f"{name}.json").write_text(json.dumps(structure, separators=(",", ":")))


def load_state(directory: Path, name: str) -> object:
    """The state `save_state` wrote; DFlashCacheError naming the file for anything else."""
    json_path, tensor_path = Path(directory) / f"{name}.json", Path(directory) / f"{name}.safetensors"
    for path in (json_path, tensor_path):
        if not path.is_file():
            raise DFlashCacheError(
                f"{path} is missing; this checkpoint is incomplete or was written by an older "
                "dflash-cache (whose pickled train_state.pt is not read: it could run code)"
            )
    try:
        structure = json.loads(json_path.read_text())
        tensors = load_file(tensor_path)
    except (*JSON_FILE_ERRORS, SafetensorError) as e:
        raise DFlashCacheError(f"{directory}: unreadable training state ({e})") from None

    def decode(value: object) -> object:
        if isinstance(value, list):
            return [decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) != 1:
            raise ValueError(f"an object with keys {sorted(value)[:3]}")
        ((kind, body),) = value.items()
        if kind == "tensor" and isinstance(body, str) and body in tensors:
            return tensors[body]
        if kind == "tuple" and isinstance(body, list):
            return tuple(decode(v) for v in body)
        if kind == "dict" and isinstance(body, list):
            if not all(isinstance(p, list) and len(p) == 2 and type(p[0]) in (str, int) for p in body):
                raise ValueError("a dict entry that is not a [key, value] pair")
            return {k: decode(v) for k, v in body}
        raise ValueError(f"an unknown entry {kind!r}")

    try:
        return decode(structure)
    except (ValueError, RecursionError) as e:
        raise DFlashCacheError(f"{json_path}: malformed training state ({e})") from None
