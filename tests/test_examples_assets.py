"""The committed demo assets load with plain transformers and the target predicts far better than chance."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from examples.build_assets import BuildConfig, collect_items, make_conversations, parse_args, train_tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "examples" / "assets"
# The build measured 0.216 on all held-out answers (chance: 1/2048), this test ~0.2 on its 16. 0.12 leaves room for
# other CPUs' arithmetic while still failing for an untrained or mismatched target (~0.00).
MIN_HELDOUT_ACCURACY = 0.12


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=True)
    return encoded["input_ids"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "target")


@pytest.fixture(scope="module")
def heldout() -> list[dict]:
    return read_jsonl(ASSETS / "data" / "heldout.jsonl")


def test_tokenizer_special_tokens_and_chat_template(tokenizer):
    assert tokenizer.mask_token == "<|mask|>"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"])
    assert len(set(ids)) == 4 and tokenizer.unk_token_id not in ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Explain `json.dumps`."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nExplain `json.dumps`.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_data_files_are_conversations_about_disjoint_modules(tokenizer, heldout):
    train = read_jsonl(ASSETS / "data" / "train.jsonl")
    report = json.loads((ASSETS / "build_report.json").read_text())
    heldout_modules = set(report["data"]["heldout_modules"])
    assert len(train) > 2000 and len(heldout) > 50
    for row in train + heldout:
        roles = [m["role"] for m in row["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
        assert all(m["content"].strip() for m in row["messages"])

    def asked_modules(rows: list[dict]) -> set[str]:
        questions = [m["content"] for row in rows for m in row["messages"] if m["role"] == "user"]
        return {name.split(".")[0] for q in questions for name in re.findall(r"`([^`]+)`", q)}

    assert asked_modules(heldout) <= heldout_modules
    assert not asked_modules(train) & heldout_modules
    assert any(len(row["messages"]) > 3 for row in train), "some conversations are multi-turn"
    lengths = [len(chat_ids(tokenizer, row["messages"])) for row in train[:500] + heldout]
    assert sum(n < 512 for n in lengths) / len(lengths) > 0.98


@torch.no_grad()
def test_target_predicts_heldout_answers_far_above_chance(tokenizer, heldout):
    # The weights are stored in bf16; computing in fp32 is much faster on most CPUs.
    model = AutoModelForCausalLM.from_pretrained(ASSETS / "target", dtype=torch.float32)
    assert model.config.model_type == "qwen3" and not model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tokenizer)
    prompts, fulls = [], []
    for row in heldout[:16]:
        messages = row["messages"]
        first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompts.append(chat_ids(tokenizer, messages[:first_answer], add_generation_prompt=True))
        fulls.append(chat_ids(tokenizer, messages[: first_answer + 1]))
        assert fulls[-1][: len(prompts[-1])] == prompts[-1]
    # One right-padded batch: causal attention keeps the padding out of every real position.
    width = max(map(len, fulls))
    input_ids = torch.tensor([full + [tokenizer.pad_token_id] * (width - len(full)) for full in fulls])
    attention_mask = torch.tensor([[1] * len(full) + [0] * (width - len(full)) for full in fulls])
    predicted = model(input_ids=input_ids, attention_mask=attention_mask).logits.argmax(-1)
    correct = total = 0
    for row, prompt, full in zip(predicted, prompts, fulls):
        answer = torch.tensor(full[len(prompt) : len(full) - 1])  # through <|im_end|>, not the final newline
        correct += (row[len(prompt) - 1 : len(full) - 2] == answer).sum().item()
        total += len(answer)
    print(f"held-out answer accuracy {correct / total:.3f} over {total} tokens")
    assert correct / total > MIN_HELDOUT_ACCURACY


# A bf16 near-tie that the CPU's kernels break differently by instruction set: the answers were made
# on a machine with AMX; on an AMD EPYC without it one token of line 49 is 0.031 logits below the
# argmax, and greedy generation then takes the other branch.
GREEDY_TIE = 0.0625


@pytest.mark.slow
def test_regenerated_training_answers_are_the_targets_own(tokenizer):
    """data/train_regenerated.jsonl: train.jsonl's conversations, each answer the target's greedy output:
    teacher-forced, every answer token is the target's argmax, or within a bf16 near-tie of it."""
    train = read_jsonl(ASSETS / "data" / "train.jsonl")
    regenerated = read_jsonl(ASSETS / "data" / "train_regenerated.jsonl")
    report = json.loads((ASSETS / "build_report.json").read_text())["regenerated"]
    assert len(regenerated) == len(train) == report["records"]
    by_line = {int(r["source"].rsplit(":", 1)[1]): r for r in regenerated}
    assert sorted(by_line) == list(range(1, len(train) + 1))
    for line, original in enumerate(train, start=1):
        new = by_line[line]["messages"]
        assert [(m["role"], m["content"]) for m in new if m["role"] != "assistant"] == [
            (m["role"], m["content"]) for m in original["messages"] if m["role"] != "assistant"
        ]
    model = AutoModelForCausalLM.from_pretrained(ASSETS / "target", dtype="auto").eval()
    for line in (1, 2, 49):  # 49 has three assistant turns, each asked with the new answers before it
        messages = by_line[line]["messages"]
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt = chat_ids(tokenizer, messages[:i], add_generation_prompt=True)
                full = chat_ids(tokenizer, messages[: i + 1])
                with torch.no_grad():
                    logits = model(torch.tensor([full])).logits[0].float()
                # each answer token, through <|im_end|>, from the position before it
                positions = torch.arange(len(prompt) - 1, len(full) - 2)
                chosen = logits[positions, torch.tensor(full)[positions + 1]]
                gaps = logits[positions].max(-1).values - chosen
                assert gaps.max() <= GREEDY_TIE, (line, i, gaps.max().item())
                assert (gaps > 0).sum() <= 2, (line, i)


def test_builder_data_is_deterministic():
    config = BuildConfig()
    items = collect_items(("json", "textwrap"), config.max_answer_chars)
    assert items == collect_items(("json", "textwrap"), config.max_answer_chars)
    assert {item.kind for item in items} >= {"module", "function", "class", "method", "source"}
    first = make_conversations(items, config, random.Random(0))
    assert first == make_conversations(items, config, random.Random(0))
    texts = [{"messages": [{"role": "user", "content": item.text}]} for item in items]
    assert train_tokenizer(texts, 400).get_vocab() == train_tokenizer(texts, 400).get_vocab()


def test_help_describes_the_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "python examples/build_assets.py --out examples/assets" in capsys.readouterr().out
