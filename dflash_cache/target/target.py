"""Load a target model for extraction and choose which of its decoder layers to capture."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from dflash_cache.errors import DFlashCacheError
from dflash_cache.target.families import check_extractable, padded_attention
from dflash_cache.target.info import read_target_info
from dflash_cache.target.loading_bars import no_loading_bars
from dflash_cache.target.parallel import Group, load_split


@dataclass
class Target:
    path: Path
    model: PreTrainedModel  # a *ForCausalLM in eval mode, no grads
    tokenizer: PreTrainedTokenizerBase
    config: object  # the text model's config (a multimodal checkpoint's text_config)
    num_layers: int
    hidden_size: int
    vocab_size: int
    config_hash: str  # sha256 of the canonical config.json; identifies the target in a cache
    attention: str  # transformers' attention implementation it was loaded with

    @property
    def base(self) -> nn.Module:
        """The decoder without its LM head: embeddings, layers, final norm."""
        return self.model.model

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers


def load_target(
    path: str | Path,
    device: str | torch.device,
    dtype: torch.dtype = torch.bfloat16,
    attention: str | None = None,
    group: Group | None = None,
) -> Target:
    """`attention`: target/varlen.py's implementation for packed rows, or None: the family's own for
    padded batches (target/families.py); `group`: this process's tensor-parallel group, whose
    ranks each hold a part of the target (target/parallel.py)."""
    info = read_target_info(path)
    check_extractable(info)
    path = info.path
    attention = attention or padded_attention(info.config.get_text_config(), device)
    with no_loading_bars():
        if group is not None and group.size > 1:
            model = load_split(path, dtype, attention, group)
        else:
            # Loaded on the CPU then moved: placing weights straight on a device needs `accelerate`.
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attention, local_files_only=True
            ).to(device)
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Target(
        path=path,
        model=model,
        tokenizer=tokenizer,
        config=model.config,
        num_layers=len(model.model.layers),
        hidden_size=model.config.hidden_size,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        config_hash=info.config_hash,
        attention=attention,
    )


DEFAULT_DRAFT_LAYERS = 5


def resolve_layer_ids(num_layers: int, layers: list[int] | None, num_draft_layers: int | None) -> list[int]:
    """The target layers to capture: an explicit list, or N chosen by rule (None: the default N).

    N = 1 takes the middle layer (num_layers // 2). Otherwise, when layers 1..num_layers-3 hold N
    distinct ones, N are spread evenly over them, as the reference DFlash code does
    (`build_target_layer_ids`, Python's round-half-to-even included), so drafters trained here line up
    with its checkpoints. A shallower target gets N spread evenly over all its layers 0..num_layers-1
    (the reference rule would repeat layers there). The default N is 5, or every layer of a target
    with fewer.
    """
    if layers is not None and num_draft_layers is not None:
        raise DFlashCacheError("give either --layers or --num-draft-layers, not both")
    if layers is not None:
        if not layers:
            raise DFlashCacheError("--layers is empty; give at least one target layer index")
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise DFlashCacheError(f"layer index {bad[0]} is out of range: the target has layers 0..{num_layers - 1}")
        if any(a >= b for a, b in zip(layers, layers[1:])):
            raise DFlashCacheError(f"--layers must be strictly increasing without repeats, got {layers}")
        return list(layers)
    n = min(DEFAULT_DRAFT_LAYERS, num_layers) if num_draft_layers is None else num_draft_layers
    if not 1 <= n <= num_layers:
        raise DFlashCacheError(
            f"--num-draft-layers {n} does not fit a {num_layers}-layer target: use 1..{num_layers} or pass --layers"
        )
    if n == 1:
        return [num_layers // 2]
    start, end = (1, num_layers - 3) if num_layers - 3 >= n else (0, num_layers - 1)
    return [round(start + i * (end - start) / (n - 1)) for i in range(n)]
