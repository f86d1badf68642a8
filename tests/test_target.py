"""Loading a target, choosing its layers, and writing the frozen head pieces a cache carries."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    BertLMHeadModel,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    T5Config,
)

from dflash_cache.errors import DFlashCacheError
from dflash_cache.target.head import save_target_files
from dflash_cache.target.info import config_hash
from dflash_cache.target.runner import TargetRunner
from dflash_cache.target.target import load_target, resolve_layer_ids
from tests.tiny import build_tokenizer, target_config

# --- layer ids ---------------------------------------------------------------------------------


def test_layer_ids_follow_reference_rule():
    assert resolve_layer_ids(36, None, 5) == [1, 9, 17, 25, 33]
    assert resolve_layer_ids(64, None, 5) == [1, 16, 31, 46, 61]
    assert resolve_layer_ids(36, None, 1) == [18]
    assert resolve_layer_ids(6, None, 3) == [1, 2, 3]  # as many as fit
    assert resolve_layer_ids(4, None, 1) == [2]


def test_layer_ids_default_and_shallow_targets():
    # No N given: 5 by the reference rule on a deep target, every layer of a target with fewer than 5.
    assert resolve_layer_ids(64, None, None) == [1, 16, 31, 46, 61]
    assert resolve_layer_ids(8, None, None) == [1, 2, 3, 4, 5]
    assert resolve_layer_ids(4, None, None) == [0, 1, 2, 3]
    assert resolve_layer_ids(2, None, None) == [0, 1]
    # Fewer than N+3 layers: N spread over all of them (0, 1.25, 2.5, 3.75, 5 rounded half to even).
    assert resolve_layer_ids(6, None, 5) == [0, 1, 2, 4, 5]
    assert resolve_layer_ids(6, None, 4) == [0, 2, 3, 5]


def test_layer_ids_explicit_list_is_validated():
    assert resolve_layer_ids(6, [0, 2, 5], None) == [0, 2, 5]
    cases = [([0, 6], "out of range"), ([-1], "out of range"), ([3, 1], "increasing"), ([2, 2], "increasing")]
    cases.append(([], "empty"))
    for layers, message in cases:
        with pytest.raises(DFlashCacheError, match=message):
            resolve_layer_ids(6, layers, None)
    with pytest.raises(DFlashCacheError, match="either"):
        resolve_layer_ids(6, [1], 2)
    for n in (0, 7):
        with pytest.raises(DFlashCacheError, match="does not fit a 6-layer target"):
            resolve_layer_ids(6, None, n)


# --- loading -----------------------------------------------------------------------------------


def test_load_target_reports_shape_and_hash(target_dir):
    target = load_target(target_dir, "cpu")
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (6, 64, len(target.tokenizer))
    assert target.model.dtype == torch.bfloat16
    assert target.model.config._attn_implementation == "sdpa"
    assert len(target.config_hash) == 64 and target.config_hash == config_hash(target_dir / "config.json")


def test_config_hash_ignores_formatting_and_library_version(tmp_path):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps({"x": 1, "y": [1, 2], "transformers_version": "5.0"}))
    b.write_text(json.dumps({"y": [1, 2], "x": 1}, indent=4))
    c.write_text(json.dumps({"x": 2, "y": [1, 2]}))
    assert config_hash(a) == config_hash(b) != config_hash(c)


def _with_tokenizer(directory):
    build_tokenizer().save_pretrained(directory)
    return directory


def test_bad_target_dirs(tmp_path, qwen3_target_dir):
    with pytest.raises(DFlashCacheError, match="does not exist"):
        load_target(tmp_path / "missing", "cpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DFlashCacheError, match="no config.json"):
        load_target(empty, "cpu")
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    (no_tok / "config.json").write_text((qwen3_target_dir / "config.json").read_text())
    with pytest.raises(DFlashCacheError, match="no tokenizer files"):
        load_target(no_tok, "cpu")

    unknown = _with_tokenizer(tmp_path / "unknown")
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(DFlashCacheError, match="cannot read config.json"):
        load_target(unknown, "cpu")

    seq2seq = _with_tokenizer(tmp_path / "t5")
    T5Config(d_model=32, num_layers=1).save_pretrained(seq2seq)
    with pytest.raises(DFlashCacheError, match="'t5' is not a causal LM.*qwen3_5"):
        load_target(seq2seq, "cpu")

    bert = _with_tokenizer(tmp_path / "bert")
    config = BertConfig(
        vocab_size=384, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    config.is_decoder = True
    BertLMHeadModel(config).save_pretrained(bert)
    with pytest.raises(DFlashCacheError, match="no decoder-layer list"):
        load_target(bert, "cpu")


def test_multimodal_qwen3_5_checkpoint_loads_its_text_model(tmp_path):
    tokenizer = build_tokenizer()
    text = target_config("qwen3_5", len(tokenizer)).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).to(torch.bfloat16)
    full.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    target = load_target(tmp_path, "cpu")
    assert (target.num_layers, target.config.model_type) == (6, "qwen3_5_text")
    input_ids = torch.randint(0, target.vocab_size, (1, 12))
    out = TargetRunner(target, [1, 3]).run(input_ids, torch.tensor([12]))
    ref = full(input_ids=input_ids, output_hidden_states=True)
    assert torch.equal(out.hidden, torch.cat([ref.hidden_states[2], ref.hidden_states[4]], dim=-1))
    assert torch.equal(out.target_ids, ref.logits.argmax(-1))


# --- target/ files -----------------------------------------------------------------------------


def test_save_target_files(target_dir, tmp_path):
    target = load_target(target_dir, "cpu")
    save_target_files(target, tmp_path)

    head = load_file(tmp_path / "head.safetensors")
    assert set(head) == {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    assert all(t.dtype == torch.bfloat16 for t in head.values())
    assert torch.equal(head["embed_tokens.weight"], target.model.get_input_embeddings().weight)
    assert torch.equal(head["lm_head.weight"], target.model.get_output_embeddings().weight)
    assert torch.equal(head["norm.weight"], target.base.norm.weight)

    meta = json.loads((tmp_path / "head.json").read_text())
    arch = target.config.model_type
    assert meta["norm_weight_offset"] == {"qwen3": 0.0, "qwen3_5_text": 1.0}[arch]
    assert meta["hidden_size"] == 64 and meta["vocab_size"] == target.vocab_size
    assert meta["rms_norm_eps"] == target.config.rms_norm_eps
    # What the drafter will compute from these files reproduces the target's own final norm.
    x = torch.randn(5, 64)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + meta["rms_norm_eps"])
    drafter_side = normed * (meta["norm_weight_offset"] + head["norm.weight"].float())
    torch.testing.assert_close(drafter_side, target.base.norm(x.bfloat16()).float(), atol=2e-2, rtol=2e-2)

    assert config_hash(tmp_path / "config.json") == target.config_hash
    saved_tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    messages = [{"role": "user", "content": "hello"}]
    assert saved_tokenizer.apply_chat_template(messages) == target.tokenizer.apply_chat_template(messages)


def test_save_target_files_with_tied_embeddings(tmp_path):
    tokenizer = build_tokenizer()
    config = target_config("qwen3", len(tokenizer))
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "tied")
    tokenizer.save_pretrained(tmp_path / "tied")

    save_target_files(load_target(tmp_path / "tied", "cpu"), tmp_path / "out")
    head = load_file(tmp_path / "out" / "head.safetensors")
    assert set(head) == {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    assert torch.equal(head["lm_head.weight"], head["embed_tokens.weight"])
