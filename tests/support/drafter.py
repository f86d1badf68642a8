"""Tiny drafter configs, target heads and packed batches shared by the drafter tests, and an untrained
drafter for the tiny targets."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_cache.drafter.checkpoint import save_drafter
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.head import TargetHead
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.stream.batch import FeatureBatch
from tests.support.extract import LAYERS

HIDDEN = 32
VOCAB = 61
MASK_ID = VOCAB - 1
RANDOM_DRAFTER_BLOCK = 6


def tiny_drafter_config(**overrides) -> DrafterConfig:
    """Both layer types, a window small enough to cut context, GQA."""
    values = dict(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        block_size=4,
        target_layer_ids=[0, 2],
        mask_token_id=MASK_ID,
        num_target_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=6,
    )
    return DrafterConfig(**{**values, **overrides})


def random_head(seed: int = 0, hidden: int = HIDDEN, vocab: int = VOCAB) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    return TargetHead(
        torch.randn(vocab, hidden, generator=g), torch.ones(hidden), torch.randn(vocab, hidden, generator=g) / 2
    )


def random_batch(
    lengths: list[int], seed: int = 0, num_layers: int = 2, hidden: int = HIDDEN, mask_rate: float = 0.3
) -> FeatureBatch:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return FeatureBatch(
        sample_ids=list(range(len(lengths))),
        input_ids=torch.randint(0, MASK_ID, (n,), generator=g),
        loss_mask=torch.rand(n, generator=g) > mask_rate,
        target_ids=torch.randint(0, MASK_ID, (n,), generator=g),
        hidden=torch.randn(n, num_layers * hidden, generator=g).bfloat16(),
        cu_seqlens=cu,
    )


def assert_same_gradients(model: torch.nn.Module, reference: torch.nn.Module, atol: float, rtol: float) -> None:
    """Each parameter's gradient in `model` is close to the same parameter's in `reference`."""
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=atol, rtol=rtol, msg=name)


def counting_backend(backend: Callable) -> tuple[list, Callable]:
    """(graphs, a torch.compile backend that records each graph it is handed, then runs `backend` on it)."""
    graphs = []

    def compile_graph(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    return graphs, compile_graph


def random_drafter(directory: Path, target_dir: Path, seed: int = 0) -> Path:
    """An untrained drafter for the tiny targets: its drafts are almost never accepted."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    config = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=len(tokenizer),
        block_size=RANDOM_DRAFTER_BLOCK,
        target_layer_ids=LAYERS,
        mask_token_id=tokenizer.mask_token_id,
        num_target_layers=6,
    )
    torch.manual_seed(seed)
    save_drafter(DFlashDrafter(config), directory)
    return directory


def save_target_head(model: torch.nn.Module, path: Path) -> None:
    """A transformers target's embedding, final norm and LM head as the head.safetensors a drafter
    checkpoint carries."""
    save_file(
        {
            "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
            "norm.weight": model.model.norm.weight.detach().clone(),
            "lm_head.weight": model.lm_head.weight.detach().clone(),
        },
        path,
    )
