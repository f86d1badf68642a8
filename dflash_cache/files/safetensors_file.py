"""Writing safetensors files with the mode of every other file we write.

`safetensors.torch.save_file` creates its file mode 0600 whatever the umask; a cache's
`target/head.safetensors` and an exported `model.safetensors` are files people share, so they get
0666 less the umask, as `open()` gives the JSON files beside them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def current_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    save_file(tensors, path, metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())
