"""Tiny caches with a target head, a tiny drafter config, and a TrainConfig for them (no tests here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_cache.train.config import TrainConfig
from tests.support.cachegen import random_spec, write_random_cache

HIDDEN, VOCAB, LAYERS = 32, 100, (1, 3)
LENGTHS = [40, 23, 57, 31, 12, 64, 45, 19, 50, 28, 36, 60, 17, 41, 33, 25]


def write_head(root: Path, hidden: int = HIDDEN, vocab: int = VOCAB, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    (root / "target").mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "embed_tokens.weight": torch.randn(vocab, hidden, generator=g).bfloat16(),
            "norm.weight": torch.ones(hidden).bfloat16(),
            "lm_head.weight": (0.2 * torch.randn(vocab, hidden, generator=g)).bfloat16(),
        },
        root / "target" / "head.safetensors",
    )


def make_cache(root: Path, lengths=LENGTHS, codec: str = "bf16-zstd", seed: int = 0, **spec) -> Path:
    spec = random_spec(codec=codec, **{"layer_ids": LAYERS, "hidden_size": HIDDEN, "vocab_size": VOCAB, **spec})
    write_random_cache(root, list(lengths), spec, seed=seed)
    write_head(root, spec["target"]["hidden_size"], spec["target"]["vocab_size"])
    return root


def drafter_json(path: Path, **overrides) -> Path:
    config = {
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": VOCAB,
        "block_size": 4,
        "target_layer_ids": list(LAYERS),
        "mask_token_id": VOCAB - 1,
        "num_target_layers": 6,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 16,
        **overrides,
    }
    path.write_text(json.dumps(config))
    return path


def tiny_train_config(tmp: Path, cache: Path, out: str = "run", **overrides) -> TrainConfig:
    drafter = tmp / "drafter.json"
    if not drafter.exists():
        drafter_json(drafter)
    values = {
        "caches": [str(cache)],
        "out": str(tmp / out),
        "drafter": str(drafter),
        "cpu_procs": 1,
        "token_budget": 128,
        "max_anchors": 8,
        "lr": 3e-3,
        "eval_fraction": 0.0,
        "save_every": 1000,
        "prefetch": 2,
        "workers": 2,
    }
    return TrainConfig(**{**values, **overrides})


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in metrics(run) if "loss" in r]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
