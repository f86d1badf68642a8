"""Random-weight targets built in place on a device (no weights on disk) and random-token samples,
shared by the benchmarks that run a target."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3_5TextConfig, Qwen3Config

from dflash_cache.data.dataset import Sample
from dflash_cache.target.info import config_hash
from dflash_cache.target.target import Target

VOCAB = 151936
SHAPES = ["qwen3-8b", "qwen3.6-27b-cut", "tiny"]


def target_config(shape: str, layers_cut: int | None = None):
    if shape == "tiny":  # a smoke test of a benchmark on the CPU
        return Qwen3Config(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
        )
    if shape == "qwen3-8b":
        return Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1e6,
            tie_word_embeddings=False,
        )
    layers = layers_cut or 64
    return Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=layers,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        tie_word_embeddings=False,
    )


def make_samples(
    total_tokens: int, vocab: int, seed: int = 0, shortest: int = 256, longest: int = 4096
) -> list[Sample]:
    """Random token ids, lengths log-uniform in [shortest, longest], until `total_tokens`."""
    rng = np.random.default_rng(seed)
    samples, tokens = [], 0
    while tokens < total_tokens:
        n = int(np.exp(rng.uniform(np.log(shortest), np.log(longest))))
        ids = rng.integers(0, vocab, n).astype(np.int32)
        samples.append(Sample(len(samples), ids, np.ones(n, dtype=bool)))
        tokens += n
    return samples


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose ids cover the whole vocabulary (so pre-tokenized data of any id passes the
    data checks), the last id being its mask token (as the drafter config reads it)."""
    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"<|mask|>": vocab_size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, mask_token="<|mask|>")


def build_target(config, device: str, folder: Path, attention: str = "sdpa") -> Target:
    """The model of `config` with random bf16 weights, initialised on `device`; `folder` gets its
    config.json and a tokenizer, as a model directory would hold them (but no weights)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attention)
    model.eval().requires_grad_(False)
    config.save_pretrained(folder)
    tokenizer = word_tokenizer(config.vocab_size)
    tokenizer.save_pretrained(folder)
    return Target(
        path=folder,
        model=model,
        tokenizer=tokenizer,
        config=config,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        config_hash=config_hash(folder / "config.json"),
        attention=attention,
    )
