"""`TargetHead`: the frozen target pieces a drafter shares (embeddings, final norm, LM head).

Plain tensors, not an `nn.Module`: they are never trained, never saved with the drafter, and DDP
neither broadcasts nor synchronises them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from dflash_cache.errors import DFlashCacheError, first_line

HEAD_KEYS = ("embed_tokens.weight", "norm.weight", "lm_head.weight")


@dataclass
class TargetHead:
    embed_tokens: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H] the target's final norm weight (the drafter applies its own norm)
    lm_head: torch.Tensor  # [V, H]

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> TargetHead:
        """Read `head.safetensors` (as the extract stage writes it into `CACHE/target/`)."""
        path = Path(path)
        if not path.is_file():
            raise DFlashCacheError(f"target head file {path} not found; it is written by `dflash-cache extract`.")
        try:
            tensors = load_file(path, device=str(device))
        except (SafetensorError, OSError) as e:
            raise DFlashCacheError(f"{path}: unreadable ({e}); re-run extract to rewrite the target head.") from None
        if missing := [k for k in HEAD_KEYS if k not in tensors]:
            raise DFlashCacheError(f"{path} lacks {missing}; re-run extract to rewrite the target head.")
        head = cls(*(tensors[k] for k in HEAD_KEYS))
        return head.apply(lambda t: t.to(dtype)) if dtype is not None else head

    @staticmethod
    def check_shapes(path: str | Path, vocab_size: int, hidden_size: int) -> None:
        """The file's tensors must have the shapes of the target the cache's spec names; read from
        its header alone, before a run folder is made (a head someone shared of another shape
        stopped the first step with a bare `RuntimeError: The size of tensor a ...`)."""
        expected = {
            "embed_tokens.weight": [vocab_size, hidden_size],
            "norm.weight": [hidden_size],
            "lm_head.weight": [vocab_size, hidden_size],
        }
        try:
            with safe_open(str(path), "pt") as f:
                found = {k: list(f.get_slice(k).get_shape()) for k in HEAD_KEYS if k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise DFlashCacheError(
                f"{path}: unreadable ({first_line(e)}); re-run extract to rewrite the target head."
            ) from None
        if found != expected:
            wrong = "; ".join(
                f"{k} is {found.get(k, 'missing')}, not {v}" for k, v in expected.items() if found.get(k) != v
            )
            raise DFlashCacheError(
                f"{path} does not hold the head of the cache's target "
                f"(vocabulary {vocab_size}, hidden size {hidden_size}): {wrong}"
            )

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.lm_head.shape[1])

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TargetHead:
        return TargetHead(fn(self.embed_tokens), fn(self.norm), fn(self.lm_head))

    def to(self, *args, **kwargs) -> TargetHead:
        return self.apply(lambda t: t.to(*args, **kwargs))
