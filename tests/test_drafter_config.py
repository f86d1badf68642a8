import json

import pytest

from dflash_cache.drafter.config import PRESETS, DrafterConfig, adapt_to_cache
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.reference import config_to_reference
from dflash_cache.errors import DFlashCacheError
from tests.test_drafter_helpers import tiny_config


def test_presets_match_the_issue():
    small = load_drafter_config("qwen3-8b")
    assert (small.num_target_layers, small.target_hidden_size) == (36, 4096)
    assert (small.num_hidden_layers, small.hidden_size, small.intermediate_size) == (5, 4096, 12288)
    assert (small.num_attention_heads, small.num_key_value_heads, small.head_dim) == (32, 8, 128)
    assert small.layer_types == ["full_attention"] * 5
    assert (small.target_layer_ids, small.block_size) == ([1, 9, 17, 25, 33], 16)

    big = load_drafter_config("qwen3.6-27b")
    assert (big.num_target_layers, big.target_hidden_size) == (64, 5120)
    assert (big.num_hidden_layers, big.hidden_size, big.intermediate_size) == (5, 5120, 17408)
    assert (big.num_attention_heads, big.num_key_value_heads, big.head_dim, big.rope_theta) == (32, 8, 128, 1e7)
    assert big.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and big.sliding_window == 2048
    assert (big.target_layer_ids, big.block_size) == ([1, 16, 31, 46, 61], 16)


def test_loading_a_preset_gives_a_copy():
    config = load_drafter_config("qwen3-8b")
    config.target_layer_ids.append(35)
    assert PRESETS["qwen3-8b"].target_layer_ids == [1, 9, 17, 25, 33]


def test_a_preset_adapts_to_the_cache_and_says_so():
    config, notes = adapt_to_cache(
        load_drafter_config("qwen3.6-27b"),
        target_hidden_size=64,
        vocab_size=384,
        mask_token_id=3,
        layer_ids=[1, 4],
        num_target_layers=6,
    )
    assert (config.hidden_size, config.target_hidden_size, config.vocab_size, config.mask_token_id) == (64, 64, 384, 3)
    assert (config.target_layer_ids, config.num_target_layers) == ([1, 4], 6)
    assert config.layer_types == PRESETS["qwen3.6-27b"].layer_types
    assert len(notes) == 6 and any("mask_token_id" in n and "-> 3" in n for n in notes)
    _, none = adapt_to_cache(config, 64, 384, 3, [1, 4], 6)
    assert none == []


def test_a_json_config_adapts_only_vocab_and_mask_token(tmp_path):
    path = tmp_path / "drafter.json"
    path.write_text(json.dumps(tiny_config().to_dict() | {"preset": None}))
    config = load_drafter_config(path)
    assert config == tiny_config()
    adapted, notes = adapt_to_cache(config, 32, 99, 7, [0, 2], 4)
    assert (adapted.vocab_size, adapted.mask_token_id) == (99, 7) and len(notes) == 2
    with pytest.raises(DFlashCacheError, match="target layers"):
        adapt_to_cache(config, 32, 99, 7, [0, 3], 4)
    with pytest.raises(DFlashCacheError, match="hidden size"):
        adapt_to_cache(config, 48, 99, 7, [0, 2], 4)


def test_a_reference_config_json_loads(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_to_reference(tiny_config(), "bfloat16")))
    assert load_drafter_config(path) == tiny_config()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
        ({"layer_types": ["full_attention", "local", "full_attention"]}, "unknown layer types"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"target_hidden_size": 48}, "hidden"),
        ({"target_layer_ids": [0, 9]}, "exceed"),
    ],
)
def test_invalid_configs_are_user_errors(change, message):
    with pytest.raises(DFlashCacheError, match=message):
        tiny_config(**change)


def test_bad_names_and_fields(tmp_path):
    with pytest.raises(DFlashCacheError, match="preset"):
        load_drafter_config("qwen9-1t")
    with pytest.raises(DFlashCacheError, match="nope.json does not exist"):
        load_drafter_config(tmp_path / "nope.json")
    path = tmp_path / "d.json"
    path.write_text(json.dumps(tiny_config().to_dict() | {"hiden_size": 3}))
    with pytest.raises(DFlashCacheError, match="hiden_size"):
        load_drafter_config(path)
    with pytest.raises(DFlashCacheError, match="incomplete"):
        DrafterConfig.from_dict({"hidden_size": 8})
