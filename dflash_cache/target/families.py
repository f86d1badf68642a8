"""What each family of target needs, read from its config alone, before any weights load: whether
extraction can run it, whether packed rows are exact for it (else padded batches), and which of
transformers' attention implementations computes its attention.

Packed rows (target/varlen.py) tell every layer where a sample ends: the attention through
`cu_seq_lens` (full, or a sliding window within the sample), rotary positions through
`position_ids`, the linear-attention layers of the qwen3_5 families through their swapped kernels.
Expert blocks route each token alone, so mixture-of-experts families pack as their attention does.
What the packed attention does not compute keeps a family on padded batches: attention sinks, logit
soft-capping, and a sliding window where torch's varlen attention takes none.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

from dflash_cache.errors import DFlashCacheError
from dflash_cache.target.info import SUPPORTED, TargetInfo
from dflash_cache.target.parallel import Weights, plan_weights
from dflash_cache.target.sink_attention import ATTENTION as SINKS_FLEX

# Families whose every layer is one of the kinds `packed_support` checks, with attention through
# transformers' attention interface and rotary positions from `position_ids`; each is run packed
# against its HF forward in tests/target/test_families.py.
PACKED_FAMILIES = (
    "qwen2",
    "qwen3",
    "llama",
    "mistral",
    "gemma3_text",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
)
# Attention terms of a family that no config field names.
ATTENTION_SINKS = ("gpt_oss",)
# The reference functions of a family's linear-attention layers that target/varlen.py swaps.
LINEAR_ATTENTION_FUNCTIONS = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")


@dataclass(frozen=True)
class Batching:
    packed: bool
    reason: str  # why, for the line that states the choice


def model_class(config) -> type:
    """The *ForCausalLM class transformers builds for `config` (a full or a text config)."""
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def sliding_window(config) -> int | None:
    """The window of the target's sliding-window layers, None when none has one."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # the families that name their layers' kinds name windowed ones
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", True) else None


def linear_attention_module(config):
    """The module holding the reference linear-attention functions of `config`'s family, or None."""
    module = importlib.import_module(model_class(config).__module__)
    return module if all(hasattr(module, name) for name in LINEAR_ATTENTION_FUNCTIONS) else None


def packed_support(config, max_length: int) -> str | None:
    """None when packed rows of samples up to `max_length` tokens are exact for the target (its
    text config), else the reason they are not."""
    kind = getattr(config, "model_type", "?")
    if kind in ATTENTION_SINKS:
        return f"{kind}'s attention sinks are not in the packed attention"
    window = sliding_window(config)
    if window is not None and window < max_length and torch.cuda.is_available() and not _varlen_takes_window():
        # A sample no longer than the window never meets it.
        return (
            f"{kind}'s sliding window of {window} tokens is shorter than --max-length {max_length}, and this "
            "torch's varlen attention takes no window"
        )
    if getattr(config, "attn_logit_softcapping", None):
        return f"{kind}'s attention logit soft-capping is not in the packed attention"
    if kind not in PACKED_FAMILIES:
        return f"model type '{kind}' is not one run packed here ({', '.join(PACKED_FAMILIES)})"
    layer_types = getattr(config, "layer_types", None) or []
    if "linear_attention" in layer_types and linear_attention_module(config) is None:
        return f"{kind}'s linear-attention layers take no sample boundaries here"
    if torch.cuda.is_available() and not _has_varlen_attn():
        return "this torch has no torch.nn.attention.varlen"
    return None


def choose_batching(config, batching: str, max_length: int) -> Batching:
    """`batching`: auto, packed or padded (extract --batching); raises for packed where it is not exact."""
    reason = packed_support(config, max_length)
    if batching == "packed" and reason is not None:
        raise DFlashCacheError(f"--batching packed: {reason}; use --batching padded")
    if batching == "padded":
        return Batching(False, "as --batching padded asks")
    if reason is not None:
        return Batching(False, reason)
    return Batching(True, f"exact for {config.model_type}: every layer sees only its own sample")


def padded_attention(config, device: str | torch.device) -> str:
    """transformers' attention implementation for padded batches: SDPA where the family has it, else
    flex attention on a GPU (it keeps no [T, T] scores per head), through target/sink_attention.py,
    which keeps gpt-oss's sinks exact; else the eager one. Read from the model class's declared support,
    not from a version."""
    cls = model_class(config)
    if getattr(cls, "_supports_sdpa", False):
        return "sdpa"
    if torch.device(device).type == "cuda" and getattr(cls, "_supports_flex_attn", False):
        return SINKS_FLEX
    return "eager"


def _varlen_takes_window() -> bool:
    from dflash_cache.target.varlen import varlen_params  # varlen.py imports this module

    return _has_varlen_attn() and "window_size" in varlen_params()


def _has_varlen_attn() -> bool:
    try:
        importlib.import_module("torch.nn.attention.varlen")
        return True
    except ImportError:
        return False


def check_extractable(info: TargetInfo) -> Weights:
    """Refuse, from the config alone, a target lacking what extraction reads; returns its parameters, as a
    tensor-parallel group holds them."""
    model = meta_model(info.config)
    missing = missing_parts(model, info.config)
    if missing:
        raise DFlashCacheError(
            f"target {info.path}: model type '{info.config.model_type}' has no {', no '.join(missing)}; "
            f"supported: {SUPPORTED}"
        )
    return plan_weights(model, info.config)


def meta_model(config) -> nn.Module:
    """The *ForCausalLM `config` builds, on the meta device: its modules and shapes, no weights, no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def missing_parts(model: nn.Module, config) -> list[str]:
    """What extraction needs that `model` (the meta_model of `config`) lacks: the decoder-layer list
    it hooks, the final norm and the LM head a cache keeps."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    missing = []
    if not isinstance(layers, nn.ModuleList) or len(layers) != config.get_text_config().num_hidden_layers:
        missing.append("decoder-layer list at model.model.layers")
    if not isinstance(getattr(getattr(base, "norm", None), "weight", None), torch.Tensor):
        missing.append("final norm with a weight at model.model.norm")
    if getattr(config.get_text_config(), "rms_norm_eps", None) is None:
        missing.append("rms_norm_eps in its config")
    if model.get_output_embeddings() is None:
        missing.append("LM head")
    return missing
