"""Tiny tokenizers, targets and data built offline from configs, shared by the tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from dflash_cache.data.dataset import Sample

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "A drafter proposes a block of tokens and the target verifies them in one forward pass.",
    "Hidden states of the chosen layers are written once and read many times for training.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "user assistant system tool: hello, how are you? I am fine, thank you very much.",
    "0123456789 numbers and letters abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]
# Crosses the 64-token chunk of the linear-attention kernel, and ends on a partial row.
PACKED_LENGTHS = [70, 5, 33, 130, 64]


def build_tokenizer(vocab_size: int = 384, chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


SLIDING_WINDOW = 16


def every(period: int, kind: str, num_layers: int) -> list[str]:
    """Layer kinds of a hybrid model: `kind`, with full attention every `period`-th layer."""
    return ["full_attention" if i % period == period - 1 else kind for i in range(num_layers)]


def target_config(arch: str, vocab_size: int, num_layers: int = 6, hidden: int = 64):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        return Qwen3Config(**common)
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    experts = dict(moe_intermediate_size=hidden // 2, num_experts=4, num_experts_per_tok=2)
    # A window shorter than the test samples, so that it binds.
    sliding = dict(sliding_window=SLIDING_WINDOW, layer_types=every(2, "sliding_attention", num_layers))
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(**common, **linear, layer_types=every(3, "linear_attention", num_layers))
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":  # Mistral-7B-v0.3 and later: no sliding window
        return MistralConfig(**common, sliding_window=None)
    if arch == "mistral_sliding":  # Mistral-7B-v0.1's sliding window
        return MistralConfig(**common, sliding_window=SLIDING_WINDOW)
    if arch == "gemma3_text":
        return Gemma3TextConfig(**common, query_pre_attn_scalar=16, **sliding)
    if arch == "gemma3_text_wide":  # a window as long as extraction's default --max-length: it never binds
        return Gemma3TextConfig(**common, query_pre_attn_scalar=16, **dict(sliding, sliding_window=8192))
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **experts, decoder_sparse_step=1)
    if arch == "qwen3_5_moe":
        common.pop("intermediate_size")
        return Qwen3_5MoeTextConfig(
            **common,
            **linear,
            **experts,
            shared_expert_intermediate_size=hidden // 2,
            layer_types=every(4, "linear_attention", num_layers),
        )
    if arch == "gpt_oss":
        # YaRN stretching the 2,048 positions from 64, so that its factor is the one it states
        rope = dict(GptOssConfig().rope_parameters, original_max_position_embeddings=64)
        # Every token takes every expert, weighted by its router, so no rounding step can change which
        # experts a token takes. With 2 of 4, one token's second and third router logits were equal in
        # bf16 even with the sharpened router, and on a GPU that token took the other expert.
        return GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=4, rope_parameters=rope, **sliding)
    raise ValueError(arch)


def build_target(directory: Path, arch: str, num_layers: int = 6, seed: int = 0, hidden: int = 64) -> Path:
    """A random-weight target with its tokenizer, saved like a Hugging Face model directory."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(target_config(arch, len(tokenizer), num_layers, hidden))
    # Random init gives near-uniform logits; sharpen the head so argmax is well separated.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
        # Experts likewise: random routers score experts nearly alike, and a rounding step then
        # flips which ones a token takes.
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.mul_(20.0)
    directory.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_conversations(path: Path, count: int = 12, seed: int = 0) -> Path:
    """JSONL conversations of varied length in the `messages` form."""
    g = torch.Generator().manual_seed(seed)
    words = " ".join(CORPUS).split()
    with open(path, "w") as f:
        for i in range(count):
            turns = []
            for _t in range(1 + i % 3):
                n_user = int(torch.randint(3, 12, (1,), generator=g))
                n_asst = int(torch.randint(5, 40, (1,), generator=g))
                pick = lambda n: " ".join(words[int(j)] for j in torch.randint(0, len(words), (n,), generator=g))  # noqa: E731
                turns.append({"role": "user", "content": pick(n_user)})
                turns.append({"role": "assistant", "content": pick(n_asst)})
            messages = ([{"role": "system", "content": "Be brief."}] if i % 2 else []) + turns
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def load_all(paths, tokenizer, max_length: int, workers: int = 0, options=None, on_bad_record: str = "error"):
    """Every sample `stream_samples` keeps from `paths`, held in one LoadedData with the data's report."""
    from dflash_cache.data.dataset import LoadedData, checked_inputs, hash_files, stream_samples

    paths, options = checked_inputs(paths, max_length, options, on_bad_record)
    data = LoadedData([], 0, hash_files(paths))
    for kept in stream_samples(data, paths, tokenizer, options, workers, on_bad_record):
        data.samples.extend(kept)
    return data


def random_samples(lengths: list[int], vocab_size: int, seed: int = 0) -> list[Sample]:
    """Samples of random token ids, every token masked for training."""
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(i, torch.randint(0, vocab_size, (n,), generator=g).numpy().astype(np.int32), np.ones(n, dtype=bool))
        for i, n in enumerate(lengths)
    ]
