"""End to end: a hybrid qwen3_5 tiny target with the Qwen3.5 chat template extracts conversations
with reasoning and tool calls; bad records stop the run or are skipped and listed; `inspect` shows
the masked tokens of each kind."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_cache import open_cache
from tests.support.cli import invoke
from tests.support.templates import FAMILIES, family_tokenizer
from tests.support.tiny import target_config

pytestmark = pytest.mark.slow

TOOL = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
# Qwen3.5 writes the call as XML, after closing the (empty) think block its generation prompt opened
CALL = (
    "\n</think>\n\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
    "</function>\n</tool_call>"
)
GOOD = [
    {
        "messages": [
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "reasoning_content": "The sum of two and three.", "content": "It is 5."},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "add 2 and 3"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
            {"role": "assistant", "reasoning_content": "The tool said 5.", "content": "The answer is 5."},
        ],
        "tools": TOOL,
    },
]


@pytest.fixture(scope="module")
def qwen3_5_target(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hybrid") / "target"
    tokenizer = family_tokenizer(FAMILIES["qwen3.5"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(target_config("qwen3_5", len(tokenizer)))
    directory.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_reasoning_and_tool_calls_end_to_end(qwen3_5_target, tmp_path):
    data = write(
        tmp_path / "data.jsonl",
        [GOOD[0], "{not json", GOOD[1], {"messages": [{"role": "user", "content": "no reply"}]}],
    )
    out = tmp_path / "cache"
    args = ["extract", "--target", qwen3_5_target, "--data", data, "--layers", "1,4", "--token-budget", 512]
    result = invoke(*args, "--out", out)
    code, _, err = result.exit_code, result.stdout, result.stderr
    assert code == 1 and "data.jsonl:2: not valid JSON" in err and err.count("\n") == 1
    assert not (out / "manifest.json").exists()

    result = invoke(*args, "--out", out, "--on-bad-record", "skip")

    code, stdout, err = result.exit_code, result.stdout, result.stderr
    assert code == 0, err
    assert "skipped 2 bad records" in err and "2 bad records" in stdout
    cache = open_cache(out)
    assert sorted(cache.lengths()) == [0, 2]
    report = cache.manifest["extract"]
    assert [b["where"] for b in report["bad_records"]] == [f"{data}:2", f"{data}:4"]
    assert report["bad_records"][1]["reason"] == "the conversation has no assistant turn, so nothing to train on"
    tokenizer = family_tokenizer(FAMILIES["qwen3.5"])
    sample = cache[2]
    masked = tokenizer.decode(sample.input_ids[sample.loss_mask].tolist())
    assert masked == (CALL + "<|im_end|>" + "The tool said 5.\n</think>\n\nThe answer is 5.<|im_end|>")
    # Counted by hand from the texts (each tokenizes alike alone and in place); markup is the rest.
    kinds = report["masked_tokens"]
    assert kinds["reasoning"] == count(tokenizer, "The sum of two and three.", "The tool said 5.")
    assert kinds["content"] == count(tokenizer, "It is 5.", "The answer is 5.")
    assert kinds["tool_call"] == count(tokenizer, CALL)  # from the end of the prompt to the end-of-turn token
    assert sum(kinds.values()) == sum(int(cache[i].loss_mask.sum()) for i in (0, 2))
    assert kinds["markup"] >= 3  # the three end-of-turn tokens at least
    assert report["unfaithful"]["count"] == 0

    result = invoke("inspect", out, "--token-budget", 512)

    code, stdout, _ = result.exit_code, result.stdout, result.stderr
    assert code == 0
    assert (
        f"masked:       {sum(kinds.values()):,} tokens: content {kinds['content']:,}" in stdout
        and f"reasoning {kinds['reasoning']:,}" in stdout
        and f"tool call {kinds['tool_call']:,}" in stdout
    )
    assert "left out:     2 bad records, 0 with nothing to train on" in stdout


def count(tokenizer, *texts: str) -> int:
    return sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)


def test_chat_template_options_are_part_of_the_spec(qwen3_5_target, tmp_path):
    data = write(tmp_path / "data.jsonl", GOOD[:1])
    out = tmp_path / "cache"
    args = [
        "extract",
        "--target",
        qwen3_5_target,
        "--data",
        data,
        "--layers",
        "1,4",
        "--out",
        out,
        "--token-budget",
        512,
    ]
    result = invoke(*args, "--chat-template-kwargs", "[1]")
    code, _, err = result.exit_code, result.stdout, result.stderr
    assert code == 2 and "--chat-template-kwargs" in err and "must be a JSON object" in err
    result = invoke(*args, "--chat-template-kwargs", '{"enable_thinking": false}')
    code, _, err = result.exit_code, result.stdout, result.stderr
    assert code == 0, err
    assert open_cache(out).spec["chat_template_kwargs"] == {"enable_thinking": False}
    result = invoke(*args, "--chat-template-kwargs", '{"enable_thinking": true}')
    code, _, err = result.exit_code, result.stdout, result.stderr
    assert code == 1 and "chat_template_kwargs.enable_thinking: False -> True" in err


def test_unfaithful_template_warns_once_or_refuses(qwen3_5_target, tmp_path):
    """Qwen3.5 renders a past turn without the think block its generation prompt opens."""
    past = {
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2"},
        ]
    }
    data = write(tmp_path / "data.jsonl", [past, GOOD[0], past])
    args = ["extract", "--target", qwen3_5_target, "--data", data, "--layers", "1,4", "--token-budget", 512]
    result = invoke(*args, "--out", tmp_path / "a")
    code, _, err = result.exit_code, result.stdout, result.stderr
    assert code == 0, err
    assert err.count("warning: the chat template does not render 2 conversations as the data has them") == 1
    assert f"e.g. {data}:1: the prompt of assistant turn 1 is not a prefix of the conversation" in err
    assert open_cache(tmp_path / "a").manifest["extract"]["unfaithful"] == {
        "count": 2,
        "examples": [
            f"{data}:1: the prompt of assistant turn 1 is not a prefix of the conversation",
            f"{data}:3: the prompt of assistant turn 1 is not a prefix of the conversation",
        ],
    }
    result = invoke(*args, "--out", tmp_path / "b", "--strict-template")
    code, _, err = result.exit_code, result.stdout, result.stderr
    assert code == 1 and "data.jsonl:1: the chat template does not render this conversation faithfully" in err
