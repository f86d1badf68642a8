"""Every family a user brings, extracted at defaults from pre-tokenized data on tiny random configs:
each sample's stored states equal its own Hugging Face forward, and each family runs the batching
that is exact for it."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, PhiConfig

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.drafter.defaults import target_drafter_config
from dflash_cache.extract.events import ExtractEvents
from dflash_cache.extract.pipeline import ExtractOptions, extract
from dflash_cache.target.precision import forward_dtype
from tests.support.tiny import build_target, build_tokenizer

TOLERANCE = 0.03
LENGTHS = [40, 23, 57, 9, 31, 64]
# By hand, from what each family's layers compute: packed rows where every layer can be told where
# a sample ends (causal attention over the whole sample or a window of it, per-token experts, linear
# attention with sequence starts); padded batches where attention adds sinks, which the packed
# attention does not compute.
BATCHING = {
    "qwen3": "packed",
    "llama": "packed",
    "mistral": "packed",
    "qwen3_5": "packed",
    "qwen3_moe": "packed",
    "qwen3_5_moe": "packed",
    "gemma3_text_wide": "packed",
    "mistral_sliding": "packed",
    "gemma3_text": "packed",
    "gpt_oss": "padded",
}


def pretokenized(path, vocab_size: int):
    g = torch.Generator().manual_seed(1)
    with open(path, "w") as f:
        for n in LENGTHS:
            ids = torch.randint(4, vocab_size, (n,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * (n // 3) + [1] * (n - n // 3)}) + "\n")
    return path


def check_family(arch: str, tmp_path, device: str) -> None:
    target = build_target(tmp_path / arch, arch, num_layers=4)
    # The reference runs where extraction ran (with flash-linear-attention installed, transformers sends
    # qwen3_5's linear attention to its Triton kernels whatever the tensors' device) and in the dtype it
    # ran in (fp32 on a CPU slow at bf16: target/precision.py).
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=forward_dtype(device), attn_implementation="eager")
    reference.eval().to(device)
    data = pretokenized(tmp_path / "data.jsonl", reference.config.vocab_size)
    plans = []

    class Plans(ExtractEvents):
        def plan(self, samples: int, tokens: int, layout: str) -> None:
            plans.append(layout)

    opts = ExtractOptions(
        target=target, data=[data], out=tmp_path / "cache", token_budget=128, gpus=None if device == "cpu" else [0]
    )
    extract(opts, Plans())
    assert plans[0].startswith(BATCHING[arch]), plans[0]
    cache = open_cache(tmp_path / "cache")
    assert cache.spec["layer_ids"] == [0, 1, 2, 3]
    assert sorted(cache) == list(range(len(LENGTHS)))
    for sid in sorted(cache):
        sample = cache[sid]
        assert len(sample.input_ids) == LENGTHS[sid]
        ids = sample.input_ids[None].long().to(device)
        with torch.no_grad():
            out = reference(ids, output_hidden_states=True)
        # The last of HF's hidden states has the final norm applied: the last layer's own output
        # is the norm's input.
        final = []
        hook = reference.model.norm.register_forward_pre_hook(lambda module, args: final.append(args[0][0]))
        with torch.no_grad():
            reference(ids)
        hook.remove()
        expected = torch.cat([*(out.hidden_states[i + 1][0] for i in range(3)), final[0]], dim=-1).cpu()
        # Other batch shapes round bf16 differently, by up to a few bf16 steps of each layer's
        # largest state; a wrong mask, position or expert is off by a sizeable part of it.
        for layer, (got, want) in enumerate(zip(sample.hidden.float().chunk(4, -1), expected.float().chunk(4, -1))):
            off = (got - want).abs().amax(-1) > TOLERANCE * want.abs().max()
            assert not off.any(), f"sample {sid}, layer {layer}: tokens {off.nonzero()[:, 0].tolist()} of {len(off)}"
        logits = out.logits[0].float().cpu()
        gap = logits.amax(-1) - logits.gather(1, sample.target_ids[:, None].long())[:, 0]
        # A label may differ only where the states' rounding can reorder the top logits.
        assert (gap <= TOLERANCE * logits.abs().amax(-1)).all()
        assert (gap == 0).float().mean() >= 0.9


@pytest.mark.parametrize("arch", list(BATCHING))
def test_family_extracts_its_hf_forward(arch, tmp_path):
    check_family(arch, tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", list(BATCHING))
def test_family_extracts_its_hf_forward_on_a_gpu(arch, tmp_path):
    check_family(arch, tmp_path, "cuda")


@pytest.mark.parametrize(
    ("config", "missing"),
    [
        (GPT2Config(n_embd=32, n_layer=2, n_head=2), "no decoder-layer list at model.model.layers, no final norm"),
        (PhiConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2), "no final norm with a weight"),
    ],
)
def test_an_unsupported_family_is_refused_from_its_config(config, missing, tmp_path):
    """No weight file at all: the refusal comes before any would load."""
    config.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    data = pretokenized(tmp_path / "data.jsonl", 64)
    with pytest.raises(DFlashCacheError) as refused:
        extract(ExtractOptions(target=tmp_path, data=[data], out=tmp_path / "cache"))
    message = str(refused.value)
    assert f"model type '{config.model_type}' has {missing}" in message and "\n" not in message
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("arch", "ffn"), [("qwen3_moe", 128), ("gpt_oss", 128), ("qwen3_5_moe", 2 * 32 + 32)])
def test_the_default_drafter_of_a_mixture_of_experts_target(arch, ffn, tmp_path):
    """The dense FFN width the config gives (qwen3_moe's, gpt_oss's), else 2 experts per token of 32
    plus a shared expert of 32 (tests/support/tiny.py's qwen3_5_moe)."""
    config = target_drafter_config(build_target(tmp_path / arch, arch, num_layers=4), [0, 1, 2, 3], mask_token_id=5)
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.head_dim) == (
        64,
        ffn,
        4,
        16,
    )
