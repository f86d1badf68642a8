"""Load a target model for extraction and choose which of its decoder layers to capture."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from dflash_cache.errors import DFlashCacheError

SUPPORTED = (
    "dense decoders whose layers are `model.model.layers` (Qwen3, Llama and alike) "
    "and hybrid qwen3_5 text or multimodal checkpoints"
)
# Any one of these is enough for AutoTokenizer to build a tokenizer from a local directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


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

    @property
    def base(self) -> nn.Module:
        """The decoder without its LM head: embeddings, layers, final norm."""
        return self.model.model

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers


def config_hash(config_file: Path) -> str:
    """sha256 of config.json with sorted keys and no whitespace.

    `transformers_version` is left out: re-saving the same model with a newer library must not
    look like a different target.
    """
    config = json.loads(config_file.read_text())
    config.pop("transformers_version", None)
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def load_target(path: str | Path, device: str | torch.device, dtype: torch.dtype = torch.bfloat16) -> Target:
    path = Path(path)
    if not path.is_dir():
        raise DFlashCacheError(f"target {path} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise DFlashCacheError(f"target {path} has no config.json; pass a Hugging Face model directory")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise DFlashCacheError(f"target {path} has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise DFlashCacheError(f"target {path}: cannot read config.json ({_first_line(e)}); supported: {SUPPORTED}")
    if type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        kind = getattr(hf_config, "model_type", "?")
        raise DFlashCacheError(f"target {path}: model type '{kind}' is not a causal LM; supported: {SUPPORTED}")
    # Loaded on the CPU then moved: placing weights straight on a device needs `accelerate`.
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", local_files_only=True
    ).to(device)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) != model.config.num_hidden_layers:
        raise DFlashCacheError(
            f"target {path}: {type(model).__name__} has no decoder-layer list at model.model.layers to hook; "
            f"supported: {SUPPORTED}"
        )
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Target(
        path=path,
        model=model,
        tokenizer=tokenizer,
        config=model.config,
        num_layers=len(layers),
        hidden_size=model.config.hidden_size,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        config_hash=config_hash(path / "config.json"),
    )


def resolve_layer_ids(num_layers: int, layers: list[int] | None, num_draft_layers: int | None) -> list[int]:
    """The target layers to capture: an explicit list, or N spread evenly over layers 1..num_layers-3.

    The spread follows the reference DFlash code (`build_target_layer_ids`), including Python's
    round-half-to-even, so drafters trained here line up with its checkpoints.
    """
    if (layers is None) == (num_draft_layers is None):
        raise DFlashCacheError("give either --layers or --num-draft-layers, not both and not neither")
    if layers is not None:
        if not layers:
            raise DFlashCacheError("--layers is empty; give at least one target layer index")
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise DFlashCacheError(f"layer index {bad[0]} is out of range: the target has layers 0..{num_layers - 1}")
        if any(a >= b for a, b in zip(layers, layers[1:])):
            raise DFlashCacheError(f"--layers must be strictly increasing without repeats, got {layers}")
        return list(layers)
    n = num_draft_layers
    if n == 1:
        return [num_layers // 2]
    most = num_layers - 3  # distinct ids available in 1..num_layers-3
    if not 1 <= n <= most:
        raise DFlashCacheError(
            f"--num-draft-layers {n} does not fit a {num_layers}-layer target: use 1..{max(most, 1)} or pass --layers"
        )
    start, span = 1, num_layers - 4
    return [round(start + i * span / (n - 1)) for i in range(n)]


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
