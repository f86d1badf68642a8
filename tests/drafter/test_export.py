"""Our export against the reference implementation (`dflash` 0.1.0 on PyPI, class DFlashDraftModel)."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.checkpoint import save_drafter
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.export import export_checkpoint
from dflash_cache.drafter.head import TargetHead
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache_cli.main import main
from tests.support.drafter import random_batch, save_target_head
from tests.support.reference import reference_model_class

BLOCK = 4


@pytest.fixture(scope="module")
def target(qwen3_target_dir):
    model = AutoModelForCausalLM.from_pretrained(qwen3_target_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(qwen3_target_dir)


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    """A drafter with a sliding (window 8) and a full-attention layer, saved, exported in fp32 and
    loaded with the reference; plus our model on the target's head."""
    model, tokenizer = target
    root = tmp_path_factory.mktemp("export")
    save_target_head(model, root / "head.safetensors")
    config = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        block_size=BLOCK,
        target_layer_ids=[1, 4],
        mask_token_id=tokenizer.mask_token_id,
        num_target_layers=6,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    )
    torch.manual_seed(0)
    ours = DFlashDrafter(config, TargetHead.load(root / "head.safetensors"), tile=16)
    with torch.no_grad():  # give the norms non-trivial weights so a misplaced norm shows
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    save_drafter(ours, root / "checkpoint")
    export_checkpoint(root / "checkpoint", root / "export", dtype="float32")
    reference, info = reference_model_class().from_pretrained(
        root / "export", output_loading_info=True, dtype=torch.float32
    )
    return ours, reference.eval(), info, root


def test_the_reference_loads_the_export_with_every_key(exported):
    ours, reference, info, root = exported
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert set(load_file(root / "export" / "model.safetensors")) == set(ours.state_dict())
    assert reference.block_size == BLOCK and reference.target_layer_ids == [1, 4]
    assert reference.mask_token_id == ours.config.mask_token_id
    assert [layer.self_attn.sliding_window for layer in reference.layers] == [8, None]
    assert [layer.self_attn.is_causal for layer in reference.layers] == [True, False]
    config = json.loads((root / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and "dflash_config" in config


@torch.no_grad()
def test_reference_forward_equals_ours(exported):
    """Every block of a packed batch, against the reference run on that block's own sequence."""
    ours, reference, _, _ = exported
    batch = random_batch([30, 6, 21], seed=4, hidden=64)
    anchors = sample_anchors(batch, BLOCK, 4, torch.Generator().manual_seed(4))
    states = ours.block_states(DraftInputs.build(batch, anchors))
    positions, starts = batch.position_ids(), batch.cu_seqlens.long()[batch.sequence_ids()]
    assert (positions[anchors] > 8).sum() >= 3  # the window cuts the context of several blocks
    for j, a in enumerate(anchors.tolist()):
        p = int(positions[a])
        block = torch.full((BLOCK,), ours.config.mask_token_id)
        block[0] = batch.input_ids[a]
        expected = reference(
            position_ids=torch.arange(p + BLOCK)[None],
            noise_embedding=ours.head.embed_tokens[block][None],
            target_hidden=batch.hidden[int(starts[a]) : a].float()[None],
        )[0]
        torch.testing.assert_close(states[j], expected, atol=2e-5, rtol=2e-5)


def test_reference_speculative_generation_reproduces_greedy_output(exported, target):
    _, reference, _, _ = exported
    model, tokenizer = target
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello, how are you?"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    new_tokens = 12  # prompt and output exceed the window of 8: the sliding layer's cache is trimmed too
    drafted = reference.spec_generate(model, prompt, max_new_tokens=new_tokens, stop_token_ids=None)
    greedy = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            greedy = torch.cat([greedy, model(greedy).logits[:, -1:].argmax(-1)], dim=1)
    assert drafted.tolist() == greedy.tolist()


def test_export_command(exported, tmp_path):
    _, _, _, root = exported
    result = CliRunner().invoke(main, ["export", str(root / "checkpoint"), "--out", str(tmp_path / "bf16")])
    assert result.exit_code == 0, result.output
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"

    result = CliRunner().invoke(main, ["export", str(tmp_path), "--out", str(tmp_path / "x")])
    assert result.exit_code == 1 and "not a drafter checkpoint" in result.output


def test_export_into_a_folder_that_holds_something_else_is_refused(tmp_path):
    """A mistyped --out (a cache, a run, any folder of files) gets no export mixed into it or written
    over its files; an earlier export is replaced."""
    from tests.support.drafter import random_head, tiny_drafter_config

    save_drafter(DFlashDrafter(tiny_drafter_config(), random_head(), tile=16), tmp_path / "checkpoint")
    cache = tmp_path / "cache"
    (cache / "shards").mkdir(parents=True)
    (cache / "config.json").write_text('{"mine": 1}\n')
    (cache / "manifest.json").write_text("{}\n")
    before = {p.name: p.read_bytes() for p in cache.iterdir() if p.is_file()}
    result = CliRunner().invoke(main, ["export", str(tmp_path / "checkpoint"), "--out", str(cache)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert (
        f"--out {cache} holds files that are not an export's (manifest.json, shards); choose a new or empty folder"
        in result.stderr
    )
    assert {p.name: p.read_bytes() for p in cache.iterdir() if p.is_file()} == before

    first = CliRunner().invoke(main, ["export", str(tmp_path / "checkpoint"), "--out", str(tmp_path / "e")])
    assert first.exit_code == 0 and "replacing" not in first.output, first.output
    again = CliRunner().invoke(
        main, ["export", str(tmp_path / "checkpoint"), "--out", str(tmp_path / "e"), "--dtype", "float32"]
    )
    assert again.exit_code == 0 and "replacing the export that was there" in again.output, again.output
    assert all(t.dtype == torch.float32 for t in load_file(tmp_path / "e" / "model.safetensors").values())


def test_a_checkpoint_path_that_does_not_exist_is_named_as_such(tmp_path):
    """It was "... is not a drafter checkpoint (it needs drafter.safetensors ...)" for a typo."""
    for command in (
        ["export", str(tmp_path / "runn"), "--out", str(tmp_path / "e")],
        ["eval", "--drafter", str(tmp_path / "runn"), "--cache", str(tmp_path)],
    ):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
        assert f"error: {tmp_path / 'runn'} does not exist" in result.stderr, result.stderr
    assert not (tmp_path / "e").exists()
