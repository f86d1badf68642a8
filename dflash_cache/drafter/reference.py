"""The reference checkpoint layout (`dflash.model.DFlashDraftModel`, a Qwen3 config plus DFlash fields).

Parameter names are the same as ours; only the config differs. `block_size` and `num_target_layers`
sit at the top level (the reference reads them there), the mask token and target layers in
`dflash_config`. No `auto_map`: the export ships no modelling code; engines and the `dflash` package
select the class from `architectures`.
"""

from __future__ import annotations

from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.errors import DFlashCacheError

ARCHITECTURE = "DFlashDraftModel"


def config_to_reference(config: DrafterConfig, dtype: str) -> dict:
    sliding = "sliding_attention" in config.layer_types
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "layer_types": list(config.layer_types),
        "use_sliding_window": sliding,
        "sliding_window": config.sliding_window if sliding else None,
        "num_target_layers": config.num_target_layers,
        "block_size": config.block_size,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
            **({"mask_token": config.mask_token} if config.mask_token else {}),
        },
        "dtype": dtype,
    }


def config_from_reference(values: dict) -> DrafterConfig:
    """A DrafterConfig from a reference `config.json` (as released, or as we export it)."""
    dflash = values.get("dflash_config", {})
    rope = values.get("rope_parameters") or {}
    if values.get("architectures", [ARCHITECTURE]) != [ARCHITECTURE]:
        raise DFlashCacheError(f"only {ARCHITECTURE} configs are supported, not {values['architectures']}.")
    try:
        layers = values["num_hidden_layers"]
        return DrafterConfig(
            hidden_size=values["hidden_size"],
            intermediate_size=values["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=values["num_attention_heads"],
            num_key_value_heads=values.get("num_key_value_heads", values["num_attention_heads"]),
            head_dim=values.get("head_dim", values["hidden_size"] // values["num_attention_heads"]),
            vocab_size=values["vocab_size"],
            rms_norm_eps=values.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", values.get("rope_theta", 1e6)),
            max_position_embeddings=values.get("max_position_embeddings", 40960),
            block_size=dflash.get("block_size", values.get("block_size", 16)),
            target_layer_ids=dflash["target_layer_ids"],
            mask_token_id=dflash["mask_token_id"],
            mask_token=dflash.get("mask_token"),
            num_target_layers=values.get("num_target_layers", 0),
            layer_types=values.get("layer_types") or ["full_attention"] * layers,
            sliding_window=values.get("sliding_window"),
        )
    except KeyError as e:
        raise DFlashCacheError(f"the reference config lacks {e}.") from None
