"""The default drafter: the target's own shape, as the z-lab DFlash drafters are built.

Those drafters take their target's hidden size, FFN size, attention heads, KV heads and head_dim,
with 5 decoder layers and a block of 16 (Qwen3-8B -> 4096 / 12288 / 32 / 8 / 128). `--drafter target`
applies that rule to whatever target a cache holds, so a 4-layer toy target gets a toy drafter and
a 27B target a 27B-shaped one; the presets stay available by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.errors import DFlashCacheError
from dflash_cache.target.info import read_target_info

TARGET = "target"  # the --drafter name of this rule
LAYERS = 5
BLOCK_SIZE = 16


@dataclass(frozen=True)
class MaskToken:
    id: int
    text: str | None  # None: an embedding row no token uses
    why: str


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def unused_token_id(target_dir: Path, vocab_size: int) -> int | None:
    """The first embedding row past every token the tokenizer files define, if the target has one
    (Qwen3's 151669): a mask token for a tokenizer that declares none."""
    tokenizer = _json(Path(target_dir) / "tokenizer.json")
    ids = [t.get("id", -1) for t in tokenizer.get("added_tokens", [])]
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        ids += [i for i in vocab.values() if isinstance(i, int)]
    first_free = max((i for i in ids if isinstance(i, int)), default=-1) + 1
    return first_free if first_free < vocab_size else None


def unused_special_token(target_dir: Path, vocab_size: int) -> MaskToken | None:
    """A special token the target never reads in a conversation: added as special, not one the
    tokenizer names (bos, eos, pad, unk, ...) and not written by the chat template. A reserved or
    unused one by name comes first (Llama 3's reserved_special_token_N, Gemma's unusedN), else the
    last one added (SmolLM2's <empty_output>): such tokens mark pretraining documents, never chat."""
    target_dir = Path(target_dir)
    config = _json(target_dir / "tokenizer_config.json")
    named = {
        value.get("content") if isinstance(value, dict) else value
        for key, value in config.items()
        if key.endswith("_token")
    }
    template = config.get("chat_template") if isinstance(config.get("chat_template"), str) else ""
    try:
        template += (target_dir / "chat_template.jinja").read_text()
    except OSError:
        pass
    candidates = [
        (t["id"], t["content"])
        for t in _json(target_dir / "tokenizer.json").get("added_tokens", [])
        if t.get("special")
        and isinstance(t.get("id"), int)
        and isinstance(t.get("content"), str)
        and t["id"] < vocab_size
        and t["content"] not in named
        and t["content"] not in template
    ]
    if not candidates:
        return None
    reserved = [c for c in candidates if "reserved" in c[1].lower() or "unused" in c[1].lower()]
    token_id, text = reserved[0] if reserved else max(candidates)
    return MaskToken(
        token_id, text, "a special token that neither the tokenizer's named tokens nor the chat template use"
    )


def choose_mask_token(target_dir: Path, vocab_size: int) -> MaskToken:
    """The mask token for a tokenizer that declares none: a free embedding row, else an unused special token."""
    free = unused_token_id(target_dir, vocab_size)
    if free is not None:
        return MaskToken(free, None, "the first embedding row no token uses")
    special = unused_special_token(target_dir, vocab_size)
    if special is None:
        raise DFlashCacheError(
            f"the tokenizer in {target_dir} declares no mask token, every embedding row is a token and no special "
            "token is free to take its place; set mask_token_id in a drafter JSON file (--drafter FILE.json)"
        )
    return special


def _rope_theta(text_config) -> float:
    rope = getattr(text_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    return float(theta if theta is not None else getattr(text_config, "rope_theta", 1e6))


def target_drafter_config(
    target_dir: Path, layer_ids: list[int], mask_token_id: int, mask_token: str | None = None
) -> DrafterConfig:
    """The default drafter for the target whose config.json is in `target_dir`, reading `layer_ids`."""
    info = read_target_info(target_dir)
    text = info.config.get_text_config()
    heads = text.num_attention_heads
    return DrafterConfig(
        hidden_size=info.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or info.hidden_size // heads,
        vocab_size=info.vocab_size,
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(text),
        max_position_embeddings=getattr(text, "max_position_embeddings", 40960),
        block_size=BLOCK_SIZE,
        target_layer_ids=list(layer_ids),
        mask_token_id=mask_token_id,
        mask_token=mask_token,
        num_target_layers=info.num_layers,
        preset=TARGET,
    )


def parameter_count(config: DrafterConfig) -> int:
    """The drafter's own trained parameters (the shared target head is not one of them)."""
    with torch.device("meta"):
        return sum(p.numel() for p in DFlashDrafter(config).parameters())


def describe_drafter(config: DrafterConfig) -> str:
    """One line: where the shape came from, the shape, and the parameter count."""
    source = {TARGET: "the target's shape", None: "a JSON file"}.get(config.preset, f"preset {config.preset}")
    window = f", sliding window {config.sliding_window}" if "sliding_attention" in config.layer_types else ""
    mask = f" {config.mask_token}" if config.mask_token else ""
    return (
        f"drafter ({source}): {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"FFN {config.intermediate_size}, {config.num_attention_heads} heads / {config.num_key_value_heads} KV "
        f"heads of {config.head_dim}, block {config.block_size}{window}, mask token {config.mask_token_id}{mask}, "
        f"reading target layers {config.target_layer_ids}: {parameter_count(config) / 1e6:,.2f}M parameters"
    )
