"""The cache spec: everything that must be equal for two extraction runs to share one cache."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from dflash_cache.store.schema import FORMAT_VERSION
from dflash_cache.target.info import TargetInfo
from dflash_cache.target.weights import weights_digest

HIDDEN_DTYPE = "bfloat16"


def tokenizer_hash(target_path: Path) -> str:
    """sha256 over the tokenizer files the target directory holds (name and bytes, sorted)."""
    sha = hashlib.sha256()
    for name in sorted(
        [
            "tokenizer.json",
            "tokenizer_config.json",
            "tokenizer.model",
            "vocab.json",
            "merges.txt",
            "special_tokens_map.json",
            "chat_template.jinja",
        ]
    ):
        path = target_path / name
        if path.is_file():
            sha.update(name.encode() + b"\0" + path.read_bytes())
    return sha.hexdigest()


def make_spec(
    target: TargetInfo,
    layer_ids: list[int],
    codec: str,
    data_hash: str,
    max_length: int,
    topk: int,
    token_budget: int | None,
    hash_weights: bool = True,
    layout=None,
) -> dict:
    """`token_budget`: tokens per target forward, which decides how samples are batched and so the
    bf16 rounding of their hidden states (None for a live target, which batches its own way);
    `layout`: the extraction's batch layout (target/batch.py), None for a live target."""
    return {
        "target": {
            "name": target.path.name,
            "model_type": target.model_type,
            "config_hash": target.config_hash,
            "weights": weights_digest(target.path, content=hash_weights),
            "num_layers": target.num_layers,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
        },
        "layer_ids": list(layer_ids),
        "codec": codec,
        "hidden_dtype": HIDDEN_DTYPE,
        "tokenizer_hash": tokenizer_hash(target.path),
        "data_hash": data_hash,
        "max_length": max_length,
        "topk": topk,
        "token_budget": token_budget,
        # Which samples share a forward, and in what shape, changes stored bytes at bf16 rounding.
        "batching": None if layout is None else {"layout": type(layout).__name__, **dataclasses.asdict(layout)},
        # A run of another version writes other rows (format 2 added record ids) or other bytes
        # (a later version runs fused kernels): resuming across versions would mix them.
        "format_version": FORMAT_VERSION,
    }
