"""gpt-oss through target/sink_attention.py's flex attention equals its eager attention, which adds
each head's sink logit to the softmax by hand (transformers' modeling_gpt_oss), over a batch of
samples longer than its sliding window, in fp32 on the CPU."""

import torch
from transformers import AutoModelForCausalLM

from dflash_cache.target.sink_attention import ATTENTION
from tests.support.tiny import SLIDING_WINDOW, build_target


def test_sinks_flex_attention_equals_gpt_oss_eager_attention(tmp_path):
    target = build_target(tmp_path / "gpt_oss", "gpt_oss", num_layers=2)
    eager = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager").eval()
    flex = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation=ATTENTION).eval()
    # Sinks as large as the scores, so that leaving them out changes every output.
    with torch.no_grad():
        for model in (eager, flex):
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, len(layer.self_attn.sinks)))
    ids = torch.randint(4, eager.config.vocab_size, (2, 3 * SLIDING_WINDOW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = eager(ids, output_hidden_states=True).hidden_states
        got = flex(ids, output_hidden_states=True).hidden_states
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
