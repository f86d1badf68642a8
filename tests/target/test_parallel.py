"""A target split over two processes by transformers' tensor parallelism (torchrun, gloo on the CPU)
stores what one process stores, up to bf16 rounding: the split matmuls sum their halves in another order."""

import os
import subprocess
import sys

import pytest
from transformers import Qwen3_5MoeConfig

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.extract.pipeline import ExtractOptions, extract
from dflash_cache.store.manifest import read_journals, spec_differences
from dflash_cache.stream.caches import FREE_SPEC_FIELDS
from dflash_cache.target.families import meta_model
from dflash_cache.target.parallel import Weights, check_fits, group_of, plan_weights
from dflash_cache.train.distributed import free_port
from tests.support.extract import LAYERS, assert_same_cache, extract_args
from tests.support.tiny import build_target, write_conversations

TOLERANCE = 0.03  # of each layer's largest state, as in test_families.py


def test_tp_outside_torchrun_or_over_another_process_count_is_refused(tmp_path):
    with pytest.raises(DFlashCacheError, match="--tp 2 splits the target over the processes of a torchrun launch"):
        extract(ExtractOptions(target=tmp_path, data=[], out=tmp_path / "cache", tp=2))
    with pytest.raises(DFlashCacheError, match="--tp 2 with 4 processes.*--nproc-per-node 2"):
        group_of(0, 4, 2)
    assert group_of(1, 2, 2).writes is False and group_of(0, 2, 2).writes is True


def test_a_target_too_large_for_one_gpu_is_refused_naming_the_split_that_fits():
    """bf16 weights may take 80% of a GPU (68.7 GB of 80 GiB): 35B split parameters are 70 GB, so two
    GPUs; 120B are 240 GB, 3.5 GPUs' share, so four. Parameters the plan leaves whole count on every
    process: with 30B whole and 10B split a process holds 60 + 10 GB at --tp 2, 60 + 6.7 GB at --tp 3;
    40B whole (80 GB) fit at no --tp."""
    gib80 = 80 * 2**30
    with pytest.raises(DFlashCacheError, match="35.0B parameters take 65 GiB.*--nproc-per-node 2 .* --tp 2"):
        check_fits(Weights(35_000_000_000, 0), gib80, 1)
    check_fits(Weights(35_000_000_000, 0), gib80, 2)
    check_fits(Weights(8_000_000_000, 0), gib80, 1)
    with pytest.raises(DFlashCacheError, match="112 GiB per process at --tp 2.*--tp 4"):
        check_fits(Weights(120_000_000_000, 0), gib80, 2)
    with pytest.raises(DFlashCacheError, match="65 GiB per process at --tp 2.*--tp 3"):
        check_fits(Weights(10_000_000_000, 30_000_000_000), gib80, 2)
    check_fits(Weights(10_000_000_000, 30_000_000_000), gib80, 3)
    with pytest.raises(DFlashCacheError, match="40.0B of them .* whole on every process whatever --tp"):
        check_fits(Weights(2_000_000_000, 40_000_000_000), gib80, 8)


def test_the_split_count_follows_the_tensor_parallel_plan_of_the_installed_transformers():
    """A tiny qwen3_5_moe (hidden 64, 2 layers: linear attention, then full attention; 8 experts of 32,
    a shared expert of 32), counted by hand from its shapes: split are the linear attention's five
    projections (8,192 + 4,096 + 4,096 + 256 + 256), the full attention's four (8,192 + 2,048 + 2,048 +
    4,096) and each layer's shared expert (3 x 2,048); router, norms and embeddings whole; routed experts
    as the installed transformers' plan says."""
    config = Qwen3_5MoeConfig(
        text_config=dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            vocab_size=128,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            layer_types=["linear_attention", "full_attention"],
        )
    )
    model = meta_model(config)
    weights = plan_weights(model, config)
    # transformers' plan for the routed experts moved between releases: in the tensor-parallel plan
    # (5.17: split, 2 x (32,768 + 16,384) more), then in the expert-parallel plan only (whole).
    plan = config.get_text_config().base_model_tp_plan
    experts_split = any(".mlp.experts" in key for key in plan)
    assert weights.split == 16_896 + 16_384 + 2 * 6_144 + (2 * (32_768 + 16_384) if experts_split else 0)
    assert weights.split + weights.whole == sum(p.numel() for p in model.parameters())


def torchrun_extract(target, data, out, env=None, **kw) -> subprocess.CompletedProcess:
    """`extract --tp 2` under torchrun: two processes on this machine, gloo between them."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "dflash_cache_cli.main",
        *map(str, extract_args(target, data, out)),
        "--tp",
        "2",
    ]
    return subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """A tiny target, its one-process cache, and the same extraction split over two processes."""
    root = tmp_path_factory.mktemp("split")
    target = build_target(root / "target", "qwen3")
    data = write_conversations(root / "data.jsonl", count=8, seed=3)
    extract(ExtractOptions(target=target, data=[data], out=root / "one", layers=LAYERS, token_budget=300))
    run = torchrun_extract(target, data, root / "two")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "process 0 wrote the cache" in run.stdout
    return target, data, root / "one", root / "two"


@pytest.mark.slow  # torchrun's agent and two workers
def test_two_process_tensor_parallel_extraction_equals_one_process(split):
    target, data, one, two = split
    one, two = open_cache(one), open_cache(two)
    assert two.spec == {**one.spec, "tensor_parallel": 2}
    assert sorted(one) == sorted(two) == list(range(8))
    agree = total = 0
    for sid in sorted(one):
        a, b = one[sid], two[sid]
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
        for x, y in zip(a.hidden.float().chunk(2, -1), b.hidden.float().chunk(2, -1)):
            assert (x - y).abs().max() <= TOLERANCE * x.abs().max()
        agree += int((a.target_ids == b.target_ids).sum())
        total += len(a.target_ids)
    assert agree >= 0.95 * total
    # The cache records the split: a run without it is another spec, not a resume; training takes both.
    with pytest.raises(DFlashCacheError, match="tensor_parallel"):
        extract(ExtractOptions(target=target, data=[data], out=two.root, layers=LAYERS, token_budget=300))
    assert spec_differences(one.spec, two.spec, FREE_SPEC_FIELDS) == []


@pytest.mark.slow
def test_a_killed_tensor_parallel_extraction_resumes_to_the_uninterrupted_cache(split, tmp_path):
    """Process 0 killed after its second shard; torchrun ends the other. The same command resumes."""
    target, data, _, two = split
    out = tmp_path / "cache"
    killed = torchrun_extract(target, data, out, env={"DFLASH_CACHE_KILL_AT": "shard.committed:2"})
    assert killed.returncode != 0 and not (out / "manifest.json").exists()
    # Two committed; a third may have been under way (written, not journaled) when the kill came.
    assert len(read_journals(out).shards) == 2 and len(list((out / "shards").iterdir())) >= 2
    resumed = torchrun_extract(target, data, out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_cache(two, out)
