"""`DrafterConfig`: the shape of a DFlash drafter, its presets, and how it adapts to a cache."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from dflash_cache.errors import DFlashCacheError

LAYER_TYPES = ("sliding_attention", "full_attention")
SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
MAX_BLOCK_SIZE = 256  # DFlash drafts 16 tokens a block; eval and training allocate block_size slots per anchor
MAX_POSITIONS = 1 << 24  # above any model's context; serving engines size position tables from it


@dataclass
class DrafterConfig:
    # Qwen3-style decoder. hidden_size must equal the target's: the drafter embeds its block with
    # the target's embeddings and reads its logits through the target's LM head.
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    # DFlash
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int = 0
    mask_token: str | None = (
        None  # the mask token's text, where it is a token of the vocabulary (engines check the two agree)
    )
    num_target_layers: int = 0
    target_hidden_size: int = 0  # 0: same as hidden_size
    layer_types: list[str] = field(default_factory=list)  # empty: all full attention
    sliding_window: int | None = None
    preset: str | None = None  # the preset this config came from; None for a JSON file
    # >0: `fc` reads this many coordinates of a subspace-coded cache and the model holds the basis,
    # which export folds into `fc` (store/subspace.py); 0: `fc` reads the layers' states
    subspace_rank: int = 0

    def __post_init__(self) -> None:
        self.check_types()
        if not self.target_hidden_size:
            self.target_hidden_size = self.hidden_size
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.target_layer_ids = list(self.target_layer_ids)
        self.layer_types = list(self.layer_types)
        self.validate()

    def check_types(self) -> None:
        """A config file someone shared may hold "1" or 0 where the rest divides, multiplies or compares."""
        problems = [
            f"{name} must be a positive integer, not {getattr(self, name)!r}"
            for name in SIZE_FIELDS
            if type(getattr(self, name)) is not int or getattr(self, name) < 1
        ]
        problems += [
            f"{name} must be a list, not {getattr(self, name)!r}"
            for name in ("target_layer_ids", "layer_types")
            if not isinstance(getattr(self, name), (list, tuple))
        ]
        if isinstance(self.target_layer_ids, (list, tuple)) and not all(
            type(i) is int and i >= 0 for i in self.target_layer_ids
        ):
            problems.append(f"target_layer_ids must be layer numbers, not {self.target_layer_ids!r}")
        if problems:
            raise DFlashCacheError("invalid drafter config: " + "; ".join(problems) + ".")

    def validate(self) -> None:
        problems = []
        if self.target_hidden_size != self.hidden_size:
            problems.append(
                f"hidden_size {self.hidden_size} must equal the target's hidden size "
                f"{self.target_hidden_size} (the drafter shares the target's embeddings and LM head)"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if bad := sorted(set(self.layer_types) - set(LAYER_TYPES)):
            problems.append(f"unknown layer types {bad} (use {list(LAYER_TYPES)})")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            problems.append("sliding_attention layers need a sliding_window")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if type(self.block_size) is not int or not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            problems.append(f"block_size must be an integer from 2 to {MAX_BLOCK_SIZE}, not {self.block_size!r}")
        if type(self.mask_token_id) is not int or not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(
                f"mask_token_id must be a token id below vocab_size {self.vocab_size}, not {self.mask_token_id!r}"
            )
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                problems.append(f"{name} must be a finite positive number, not {value!r}")
        if self.max_position_embeddings > MAX_POSITIONS:
            problems.append(
                f"max_position_embeddings must be at most {MAX_POSITIONS:,}, not {self.max_position_embeddings:,}"
            )
        if self.sliding_window is not None and (type(self.sliding_window) is not int or self.sliding_window < 1):
            problems.append(f"sliding_window must be a positive integer or null, not {self.sliding_window!r}")
        if type(self.subspace_rank) is not int or self.subspace_rank < 0:
            problems.append(f"subspace_rank must be 0 or a positive integer, not {self.subspace_rank!r}")
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        elif self.num_target_layers and max(self.target_layer_ids) >= self.num_target_layers:
            problems.append(
                f"target_layer_ids {self.target_layer_ids} exceed the target's {self.num_target_layers} layers"
            )
        if problems:
            raise DFlashCacheError("invalid drafter config: " + "; ".join(problems) + ".")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> DrafterConfig:
        if not isinstance(values, dict):
            raise DFlashCacheError(f"a drafter config must be a JSON object, not {type(values).__name__}.")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(values) - known):
            raise DFlashCacheError(f"unknown drafter config fields {unknown}; known fields: {sorted(known)}.")
        try:
            return cls(**values)
        except TypeError as e:
            raise DFlashCacheError(f"incomplete drafter config: {e}.") from None


PRESETS: dict[str, DrafterConfig] = {
    "qwen3-8b": DrafterConfig(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1e6,
        max_position_embeddings=40960,
        block_size=16,
        target_layer_ids=[1, 9, 17, 25, 33],
        mask_token_id=151669,
        num_target_layers=36,
        layer_types=["full_attention"] * 5,
        preset="qwen3-8b",
    ),
    "qwen3.6-27b": DrafterConfig(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=248320,
        rope_theta=1e7,
        max_position_embeddings=262144,
        block_size=16,
        target_layer_ids=[1, 16, 31, 46, 61],
        mask_token_id=248070,
        num_target_layers=64,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        sliding_window=2048,
        preset="qwen3.6-27b",
    ),
}


def adapt_to_cache(
    config: DrafterConfig,
    target_hidden_size: int,
    vocab_size: int,
    mask_token_id: int,
    layer_ids: list[int],
    num_target_layers: int,
) -> tuple[DrafterConfig, list[str]]:
    """Fit `config` to the cache it trains on. Returns the new config and one message per change.

    A preset takes the cache's target hidden size, vocabulary, mask token and layers. A JSON config
    was written for one target: only the vocabulary and mask token follow the cache; a different
    hidden size or layer list is an error.
    """
    changes: dict = {}
    messages = []

    def change(name: str, value, why: str) -> None:
        if getattr(config, name) != value:
            messages.append(f"{name}: {getattr(config, name)} -> {value} ({why})")
            changes[name] = value

    change("vocab_size", vocab_size, "the cache's vocabulary")
    change("mask_token_id", mask_token_id, "the cache's tokenizer mask token")
    if "mask_token_id" in changes:
        changes["mask_token"] = None  # the text named the old id
    layer_ids = list(layer_ids)
    if config.preset is not None:
        change("hidden_size", target_hidden_size, "the cache's target hidden size")
        change("target_hidden_size", target_hidden_size, "the cache's target hidden size")
        change("target_layer_ids", layer_ids, "the layers the cache holds")
        change("num_target_layers", num_target_layers, "the cache's target")
    else:
        if config.target_hidden_size != target_hidden_size:
            raise DFlashCacheError(
                f"the drafter config expects target hidden size {config.target_hidden_size} but the cache's "
                f"target has {target_hidden_size}; use a config written for this target."
            )
        if config.target_layer_ids != layer_ids:
            raise DFlashCacheError(
                f"the drafter config reads target layers {config.target_layer_ids} but the cache holds "
                f"{layer_ids}; set target_layer_ids to {layer_ids} or extract a cache with those layers."
            )
        change("num_target_layers", num_target_layers, "the cache's target")
    return replace(config, **changes), messages
