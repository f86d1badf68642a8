"""Defaults that fit the target and the machine: the drafter from the target, device defaults, the
memory check before the first step, checkpoint retention."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dflash_cache import DFlashCacheError
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.defaults import choose_mask_token, describe_drafter, parameter_count, target_drafter_config
from dflash_cache.drafter.reference import config_from_reference, config_to_reference
from dflash_cache.target import precision
from dflash_cache.train import budget
from dflash_cache.train.budget import (
    GPU_SHARE,
    StepMemory,
    activation_bytes,
    batch_anchors,
    check_fits,
    default_anchor_cap,
    estimate_step_memory,
    fitting_anchor_cap,
)
from dflash_cache.train.checkpoint import complete_checkpoints, latest_checkpoint
from dflash_cache.train.train import echo_padding, train
from tests.support.tiny import build_target
from tests.support.train import make_cache, tiny_train_config


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("cache") / "c")


def test_the_default_drafter_takes_the_targets_shape(tmp_path):
    target = build_target(tmp_path / "t", "qwen3", num_layers=4)  # hidden 64, FFN 128, 4 heads / 2 KV of 16
    config = target_drafter_config(target, [0, 1, 2, 3], mask_token_id=5)
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads) == (64, 128, 4)
    assert (config.num_key_value_heads, config.head_dim, config.num_hidden_layers, config.block_size) == (2, 16, 5, 16)
    assert (config.target_layer_ids, config.num_target_layers, config.mask_token_id) == ([0, 1, 2, 3], 4, 5)
    assert config.layer_types == ["full_attention"] * 5 and config.preset == "target"


def _tokenizer_files(directory, added: list[tuple[str, bool]], vocab: int = 4, **config) -> int:
    """A tokenizer's files: `vocab` plain tokens, then the `added` (text, special) ones; returns the total."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens = [{"id": vocab + i, "content": text, "special": special} for i, (text, special) in enumerate(added)]
    (directory / "tokenizer.json").write_text(
        json.dumps({"added_tokens": tokens, "model": {"vocab": {f"w{i}": i for i in range(vocab)}}})
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return vocab + len(added)


def test_a_tokenizer_without_a_mask_token_or_a_free_row_gets_an_unused_special_token(tmp_path):
    """SmolLM2's case: every embedding row is a token and none is a mask. The token chosen is a special
    one that the tokenizer's named tokens and the chat template never use: the last one added, or a
    reserved one by name first; a free embedding row, where there is one, before any of them."""
    added = [
        ("<|endoftext|>", True),
        ("<|im_start|>", True),
        ("<|im_end|>", True),
        ("<filename>", True),
        ("<empty_output>", True),
        ("plain", False),
    ]
    named = {
        "eos_token": "<|im_end|>",
        "unk_token": {"content": "<|endoftext|>"},
        "chat_template": "{{ '<|im_start|>' + m['content'] }}",
    }
    size = _tokenizer_files(tmp_path / "a", added, **named)
    chosen = choose_mask_token(tmp_path / "a", size)
    assert (chosen.id, chosen.text) == (8, "<empty_output>")
    assert choose_mask_token(tmp_path / "a", size + 3).id == size  # a spare row comes first
    assert choose_mask_token(tmp_path / "a", size + 3).text is None

    size = _tokenizer_files(tmp_path / "b", [("<|reserved_special_token_0|>", True)] + added, **named)
    assert (choose_mask_token(tmp_path / "b", size).id, choose_mask_token(tmp_path / "b", size).text) == (
        4,
        "<|reserved_special_token_0|>",
    )

    size = _tokenizer_files(tmp_path / "c", added[:3], **named)
    with pytest.raises(DFlashCacheError, match="declares no mask token, every embedding row is a token and no special"):
        choose_mask_token(tmp_path / "c", size)


def test_the_chosen_mask_token_is_exported_where_the_engines_read_it():
    """z-lab/dflash and vLLM read dflash_config.mask_token_id; SGLang also dflash_config.mask_token,
    the text it checks against the id (an absent one defaults to a text the vocabulary lacks)."""
    config = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        target_layer_ids=[1],
        mask_token_id=8,
        mask_token="<empty_output>",
    )
    exported = config_to_reference(config, "bfloat16")["dflash_config"]
    assert (exported["mask_token_id"], exported["mask_token"]) == (8, "<empty_output>")
    back = config_from_reference(config_to_reference(config, "bfloat16"))
    assert (back.mask_token_id, back.mask_token) == (8, "<empty_output>")
    assert (
        "mask_token"
        not in config_to_reference(DrafterConfig(**{**config.to_dict(), "mask_token": None}), "bfloat16")[
            "dflash_config"
        ]
    )
    assert "mask token 8 <empty_output>" in describe_drafter(config)


def test_parameter_count_by_hand():
    config = DrafterConfig(
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=50,
        target_layer_ids=[0, 1, 2],
    )
    # fc 24x8; per layer q 8x8, k 8x4, v 8x4, o 8x8, q/k norms 4+4, MLP 3x8x12, two norms 8+8; hidden_norm, norm 8+8.
    per_layer = 64 + 32 + 32 + 64 + 8 + 288 + 16
    assert parameter_count(config) == 24 * 8 + 2 * per_layer + 16
    assert describe_drafter(config).endswith(f"{parameter_count(config) / 1e6:,.2f}M parameters")


def test_anchor_bound_and_dense_pairs_by_hand():
    # Sequences of 20, 10 and 3 tokens, block 4: candidates 17, 7, 0; at most 8 per sequence -> 8 + 7.
    assert batch_anchors([20, 10, 3], 4, 8) == 15
    assert batch_anchors([20, 10, 3], 4, 8, per_batch=10) == 10 and batch_anchors([20, 10, 3], 4, 8, per_batch=20) == 15
    config = DrafterConfig(
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=50,
        block_size=4,
        target_layer_ids=[0],
    )
    # The dense mask grid of 10 anchors x 4 = 40 queries over 100 + 40 keys, 10 bytes a pair.
    grid = activation_bytes(config, 100, 10, dense_mask=True, training=True) - activation_bytes(
        config, 100, 10, dense_mask=False, training=True
    )
    assert grid == 40 * 140 * 10


def test_a_step_that_cannot_fit_is_refused_with_the_options_to_lower():
    memory = StepMemory(weights=10**9, head=10**8, activations=4 * 10**9, tokens=2048, blocks=300)
    check_fits(memory, torch.device("cpu"), 2048, 8, (6 * 10**9, "of RAM available"))  # fits
    with pytest.raises(
        DFlashCacheError,
        match=r"needs about 5.10 GB per step .* there is 2.00 GB of RAM available; "
        r"lower --token-budget \(now 2,048\) or --max-anchors \(now 8\)",
    ):
        check_fits(memory, torch.device("cpu"), 2048, 8, (2 * 10**9, "of RAM available"))


def test_train_refuses_before_the_first_step(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(budget, "available_bytes", lambda device: (1000, "of RAM available"))
    monkeypatch.setattr("dflash_cache.train.train.available_bytes", lambda device: (1000, "of RAM available"))
    with pytest.raises(DFlashCacheError, match="there is 0.0 MB of RAM available; lower --token-budget"):
        train(tiny_train_config(tmp_path, cache, steps=2), echo=lambda s: None)
    assert latest_checkpoint(tmp_path / "run") is None
    assert (
        not (tmp_path / "run" / "metrics.jsonl").exists()
        or "loss" not in (tmp_path / "run" / "metrics.jsonl").read_text()
    )


@pytest.mark.parametrize("fast", [True, False])
def test_the_estimate_counts_the_head_and_activations_in_the_steps_dtype(tmp_path, cache, monkeypatch, fast):
    """A CPU slow at bf16 steps in fp32 (target/precision.py): the head it holds is twice the bf16 one."""
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: fast)
    seen = []

    def record(config, *args, **kwargs):
        seen.append((config, budget.estimate_step_memory(config, *args, **kwargs)))
        raise DFlashCacheError("stop before the first step")

    monkeypatch.setattr("dflash_cache.train.train.estimate_step_memory", record)
    with pytest.raises(DFlashCacheError, match="stop before"):
        train(tiny_train_config(tmp_path, cache, steps=2), echo=lambda s: None)
    ((config, estimate),) = seen
    element = 2 if fast else 4  # bytes of a bf16 or an fp32 value
    assert estimate.head == (2 * config.vocab_size + 1) * config.hidden_size * element
    bf16_activations = budget.activation_bytes(config, estimate.tokens, estimate.blocks, True, True)
    assert (estimate.activations == bf16_activations) == fast and estimate.activations >= bf16_activations


def test_estimate_grows_with_the_budget(cache):
    config = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        block_size=4,
        target_layer_ids=[1, 3],
    )
    small = estimate_step_memory(config, 0, [[40, 23], [57]], 8, "cpu", training=True)
    large = estimate_step_memory(config, 0, [[40, 23, 57, 31]], 8, "cpu", training=True)
    assert (small.tokens, small.blocks) == (63, 16) and (large.tokens, large.blocks) == (151, 32)
    assert large.activations > small.activations and large.weights == small.weights


def test_the_anchor_cap_is_the_most_that_fits():
    config = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        block_size=4,
        target_layer_ids=[1, 3],
    )
    batches = [[40, 23], [57, 31, 9]]  # up to 37 + 20 and 54 + 28 + 6 anchors

    # Each cap's estimate once: the scans of every room and step below ask for the same ones.
    totals = {
        k: estimate_step_memory(config, 0, batches, 64, "cuda", True, per_batch=k).total for k in range(1, 88 + 16)
    }

    def scan(room: int, step: int) -> int | None:  # the reference: every multiple of `step` up to the first >= 88
        return max((k for k in range(step, 88 + step, step) if totals[k] <= room), default=None)

    floor = estimate_step_memory(config, 0, batches, 64, "cuda", True, per_batch=1).total
    whole = estimate_step_memory(config, 0, batches, 64, "cuda", True).total
    for room in (floor - 1, floor, (floor + whole) // 2, whole - 1, whole):
        for step in (1, 4, 16):
            assert fitting_anchor_cap(config, 0, batches, 64, room, step) == scan(room, step), (room, step)
    assert scan(whole, 1) == 88 and scan(floor - 1, 1) is None
    # No cap where the uncapped plan fits in GPU_SHARE of the GPU.
    assert default_anchor_cap(config, batches, 64, int(whole / GPU_SHARE) + 2**30)[0] is None


def test_a_gpu_given_no_cap_takes_the_most_blocks_that_fit(tmp_path, cache, monkeypatch):
    from types import SimpleNamespace

    from dflash_cache.train.train import anchors_per_batch

    config = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        block_size=4,
        target_layer_ids=[1, 3],
    )
    batches = [[40, 23], [57, 31, 9]]
    whole = estimate_step_memory(config, budget.head_bytes(config), batches, 64, "cuda", True).total
    gpu = SimpleNamespace(device=torch.device("cuda", 0))
    cfg = tiny_train_config(tmp_path, cache, max_anchors=64)
    # the cap is a multiple of 64: 88 blocks do not fit, 64 do
    for total, expected in [(int(whole / GPU_SHARE) + 1, None), (int(whole / GPU_SHARE) - 1, 64)]:
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda device, total=total: SimpleNamespace(total_memory=total)
        )
        lines = []
        assert anchors_per_batch(cfg, config, batches, gpu, lines.append) == expected
        assert len(lines) == (expected is not None)
    assert "each batch trains on at most 64 blocks" in lines[0], lines
    assert anchors_per_batch(tiny_train_config(tmp_path, cache, anchors_per_batch=7), config, batches, gpu, print) == 7


def test_the_compiled_drafter_says_how_much_is_padding():
    lines = []
    echo_padding(lines.append, 30, [10, 20, 30])  # 20 on average: a third of 30 is padding
    assert lines == [
        "the compiled drafter pads every batch to 30 blocks; this plan's batches get 20 on average, so "
        "33% of its block rows are padding (eager mode computes none): --anchors-per-batch 10 or less "
        "gives every batch that count"
    ]
    echo_padding(lines.append, 21, [20, 20])  # under a tenth: nothing said
    assert len(lines) == 1


def test_anchors_per_batch_caps_every_step(tmp_path, cache):
    lines = []
    train(tiny_train_config(tmp_path, cache, steps=3, anchors_per_batch=2), echo=lines.append)
    blocks = [
        json.loads(line)["blocks"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert len(blocks) == 3 and max(blocks) == 2, blocks
    assert any("at most 8 blocks per sequence and 2 per batch" in line for line in lines), lines


def test_device_defaults_fill_only_what_is_not_given(tmp_path, cache):
    lines = []
    train(tiny_train_config(tmp_path, cache, steps=1, token_budget=None, max_anchors=None), echo=lines.append)
    assert any("steps of 2,048 tokens per batch, at most 8 blocks per sequence" in line for line in lines), lines
    assert any(line.startswith("memory: about ") and "of RAM available" in line for line in lines), lines
    assert any(line.startswith("drafter (a JSON file): 2 layers") for line in lines), lines


def test_keep_last_keeps_the_newest_checkpoints(tmp_path, cache):
    train(tiny_train_config(tmp_path, cache, steps=5, save_every=1, keep_last=2), echo=lambda s: None)
    assert [step for step, _ in complete_checkpoints(tmp_path / "run")] == [4, 5]
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]
    train(tiny_train_config(tmp_path, cache, out="all", steps=3, save_every=1), echo=lambda s: None)
    assert [step for step, _ in complete_checkpoints(tmp_path / "all")] == [1, 2, 3]


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_command_line_makes_idle_openmp_threads_sleep_unless_told_otherwise(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | (
        {"OMP_WAIT_POLICY": given} if given else {}
    )
    probe = "import os, dflash_cache_cli.main; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == expected
