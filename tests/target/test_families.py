"""Every family a user brings, extracted at defaults from pre-tokenized data on tiny random configs:
each sample's stored states equal its own Hugging Face forward, and each family runs the batching
that is exact for it."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_cache import open_cache
from dflash_cache.extract.pipeline import ExtractOptions, extract
from tests.tiny import build_target

LENGTHS = [40, 23, 57, 9, 31, 64]
# By hand, from what each family's layers compute: packed rows where every layer can be told where
# a sample ends (causal attention over the whole sample, per-token experts, linear attention with
# sequence starts); padded batches where attention reaches back a window (shorter here than the
# samples) or adds sinks, which the packed attention does not compute.
BATCHING = {
    "qwen3": "packed",
    "llama": "packed",
    "mistral": "packed",
    "qwen3_5": "packed",
    "qwen3_moe": "packed",
    "qwen3_5_moe": "packed",
    "mistral_sliding": "padded",
    "gemma3_text": "padded",
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
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16, attn_implementation="eager")
    reference.eval()
    data = pretokenized(tmp_path / "data.jsonl", reference.config.vocab_size)
    plans = []
    opts = ExtractOptions(
        target=target, data=[data], out=tmp_path / "cache", token_budget=128, gpus=None if device == "cpu" else [0]
    )
    extract(opts, on_plan=lambda samples, tokens, layout: plans.append(layout))
    assert plans[0].startswith(BATCHING[arch]), plans[0]
    cache = open_cache(tmp_path / "cache")
    assert cache.spec["layer_ids"] == [0, 1, 2, 3]
    assert sorted(cache) == list(range(len(LENGTHS)))
    for sid in sorted(cache):
        sample = cache[sid]
        assert len(sample.input_ids) == LENGTHS[sid]
        with torch.no_grad():
            out = reference(sample.input_ids[None].long(), output_hidden_states=True)
        # The last of HF's hidden states has the final norm applied: the last layer's own output
        # is the norm's input.
        final = []
        hook = reference.model.norm.register_forward_pre_hook(lambda module, args: final.append(args[0][0]))
        with torch.no_grad():
            reference(sample.input_ids[None].long())
        hook.remove()
        expected = torch.cat([*(out.hidden_states[i + 1][0] for i in range(3)), final[0]], dim=-1)
        # Other batch shapes round bf16 differently; a wrong mask or position is off by far more.
        torch.testing.assert_close(sample.hidden.float(), expected.float(), atol=3e-2, rtol=3e-2)
        logits = out.logits[0].float()
        gap = logits.amax(-1) - logits.gather(1, sample.target_ids[:, None].long())[:, 0]
        assert (gap <= 2 * torch.finfo(torch.bfloat16).eps * logits.abs().amax(-1)).all()
        assert (gap == 0).float().mean() >= 0.9


@pytest.mark.parametrize("arch", list(BATCHING))
def test_family_extracts_its_hf_forward(arch, tmp_path):
    check_family(arch, tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", list(BATCHING))
def test_family_extracts_its_hf_forward_on_a_gpu(arch, tmp_path):
    check_family(arch, tmp_path, "cuda")
