"""LiveSource yields the cache stream's batches bit for bit, and so trains to the same losses."""

import pytest
import torch

from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.errors import DFlashCacheError
from dflash_cache.extract.pipeline import ExtractOptions, extract
from dflash_cache.stream.caches import CacheSet
from dflash_cache.stream.epochs import TRAIN, EpochPlan, batch_seed
from dflash_cache.stream.loader import Loader
from dflash_cache.train.live import LiveSource

LAYERS = [1, 4]
SEED = 3


@pytest.fixture(scope="module")
def cache(qwen3_target_dir, conversations, tmp_path_factory):
    """A bf16-zstd cache extracted one sample per target forward (--token-budget 1)."""
    out = tmp_path_factory.mktemp("live") / "cache"
    extract(
        ExtractOptions(
            target=qwen3_target_dir, data=[conversations], out=out, layers=LAYERS, token_budget=1, batching="padded"
        )
    )
    return out


def fields(batch):
    return (batch.input_ids, batch.loss_mask, batch.target_ids, batch.hidden, batch.cu_seqlens)


def train_losses(batches, head, config: DrafterConfig, steps: int) -> list[float]:
    """A few optimizer steps the way the trainer takes them: anchors seeded by plan position, bf16 autocast."""
    torch.manual_seed(SEED)
    model = DFlashDrafter(config)
    model.head = head
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner, losses = DrafterRunner(model), []
    for index, batch in zip(range(steps), batches):
        generator = torch.Generator().manual_seed(batch_seed(SEED, TRAIN, 0, index))
        anchors = sample_anchors(batch, config.block_size, 8, generator)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = runner(batch, anchors)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return losses


def test_live_batches_and_losses_equal_the_cache(qwen3_target_dir, conversations, cache):
    caches = CacheSet([cache])
    live = LiveSource(qwen3_target_dir, [conversations], layers=LAYERS)
    assert live.lengths == caches.lengths and live.spec["layer_ids"] == caches.spec["layer_ids"]
    assert [live.split(0.3)[i] for i in (0, 1)] == [caches.split(0.3)[i] for i in (0, 1)]
    keys, _ = caches.split(0.0)
    plan = EpochPlan(keys, caches.lengths, 400, SEED, world=1, grad_accum=1).rank_batches(0, 0)
    assert len(plan) >= 3 and any(len(b) > 1 for b in plan)  # packed batches of several samples

    with Loader(caches, plan, "cpu") as loader:
        cached = list(loader)
    streamed = list(live.batches(plan, "cpu"))
    for a, b in zip(cached, streamed, strict=True):
        assert a.sample_ids == b.sample_ids
        for x, y in zip(fields(a), fields(b)):
            assert x.dtype == y.dtype and torch.equal(x, y)

    tokenizer_mask = live.runner.target.tokenizer.mask_token_id
    config = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=live.info.vocab_size,
        block_size=4,
        target_layer_ids=LAYERS,
        mask_token_id=tokenizer_mask,
        num_target_layers=6,
    )
    from dflash_cache.drafter.head import TargetHead

    from_cache = train_losses(cached, TargetHead.load(caches.head_dir / "head.safetensors"), config, len(plan))
    from_live = train_losses(streamed, live.head("cpu"), config, len(plan))
    assert from_cache == from_live
    assert len(set(from_cache)) > 1  # the steps train on different batches
    caches.close()


def test_padded_forwards_group_samples_and_stay_close(qwen3_target_dir, conversations):
    alone = LiveSource(qwen3_target_dir, [conversations], layers=LAYERS)
    grouped = LiveSource(qwen3_target_dir, [conversations], layers=LAYERS, forward_tokens=400)
    keys = [0, 3, 5, 7]
    groups = list(grouped._forwards([grouped.samples[k] for k in keys]))
    assert [s.sample_id for g in groups for s in g] == keys and len(groups) < len(keys)
    assert all(len(g) * max(len(s.input_ids) for s in g) <= 400 or len(g) == 1 for g in groups)
    a, b = alone.batch(keys, "cpu"), grouped.batch(keys, "cpu")
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)
    torch.testing.assert_close(a.hidden.float(), b.hidden.float(), atol=5e-2, rtol=5e-2)


def test_bad_options(qwen3_target_dir, conversations):
    with pytest.raises(DFlashCacheError, match="out of range"):
        LiveSource(qwen3_target_dir, [conversations], layers=[1, 99])
    with pytest.raises(DFlashCacheError, match="forward_tokens"):
        LiveSource(qwen3_target_dir, [conversations], layers=LAYERS, forward_tokens=0)
