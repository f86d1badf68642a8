"""What extraction needs to know about a target before any weights are loaded."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

from dflash_cache.errors import DFlashCacheError, first_line

SUPPORTED = (
    "dense decoders whose layers are `model.model.layers` (Qwen3, Llama and alike) "
    "and hybrid qwen3_5 text or multimodal checkpoints"
)
# Any one of these is enough for AutoTokenizer to build a tokenizer from a local directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass
class TargetInfo:
    path: Path
    config: object  # the Hugging Face config as AutoConfig reads it
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    config_hash: str


def config_hash(config_file: Path) -> str:
    """sha256 of config.json with sorted keys and no whitespace.

    `transformers_version` is left out: re-saving the same model with a newer library must not
    look like a different target.
    """
    config = json.loads(config_file.read_text())
    config.pop("transformers_version", None)
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def read_target_info(path: str | Path) -> TargetInfo:
    """Check a target directory and read its shape from config.json alone."""
    path = Path(path)
    if not path.is_dir():
        raise DFlashCacheError(f"target {path} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise DFlashCacheError(f"target {path} has no config.json; pass a Hugging Face model directory")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise DFlashCacheError(f"target {path} has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise DFlashCacheError(
            f"target {path}: cannot read config.json ({first_line(e)}); supported: {SUPPORTED}"
        ) from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        kind = getattr(config, "model_type", "?")
        raise DFlashCacheError(f"target {path}: model type '{kind}' is not a causal LM; supported: {SUPPORTED}")
    text = config.get_text_config()
    return TargetInfo(
        path=path,
        config=config,
        model_type=text.model_type,
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        vocab_size=text.vocab_size,
        config_hash=config_hash(path / "config.json"),
    )
