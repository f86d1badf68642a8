import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_cache.data.dataset import EncodeOptions
from dflash_cache.data.tokenize import tokenize_conversation
from dflash_cache.errors import DFlashCacheError
from tests.support.tiny import build_tokenizer, load_all


@pytest.fixture
def files(tmp_path, conversations):
    """Three files of different forms: 12 conversations, 2 ShareGPT records, 3 pre-tokenized rows."""
    sharegpt = tmp_path / "sharegpt.jsonl"
    sharegpt.write_text(
        json.dumps({"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi there"}]})
        + "\n"
        + json.dumps(
            {
                "conversations": [
                    {"from": "system", "value": "be brief"},
                    {"from": "user", "value": "q"},
                    {"from": "assistant", "value": "the answer"},
                ]
            }
        )
        + "\n"
    )
    tokens = tmp_path / "tokens.parquet"
    pq.write_table(
        pa.table({"input_ids": [[1, 2, 3], list(range(10, 60)), [7]], "loss_mask": [[0, 1, 1], [1] * 50, [1]]}), tokens
    )
    return [conversations, sharegpt, tokens]


def test_load_all_forms_with_stable_ids(files, tokenizer):
    data = load_all(files, tokenizer, max_length=4096)
    assert [s.sample_id for s in data.samples] == list(range(17))
    assert data.num_truncated == 0
    first_conversation = json.loads(files[0].read_text().splitlines()[0])["messages"]
    ids, mask = tokenize_conversation(tokenizer, first_conversation)
    assert data.samples[0].input_ids.tolist() == ids and data.samples[0].loss_mask.tolist() == [bool(m) for m in mask]
    sharegpt = data.samples[12]
    assert tokenizer.decode(sharegpt.input_ids[sharegpt.loss_mask]) == "hi there<|im_end|>"
    assert data.samples[14].input_ids.tolist() == [1, 2, 3]
    assert data.samples[14].loss_mask.tolist() == [False, True, True]
    for s in data.samples:
        assert s.input_ids.dtype == np.int32 and s.loss_mask.dtype == bool
        assert len(s.input_ids) == len(s.loss_mask)
    expected_hash = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()
    assert data.source_hash == expected_hash
    # The same file in a different order: ids follow the order, the hash changes.
    reordered = load_all(files[::-1], tokenizer, max_length=4096)
    assert reordered.samples[0].input_ids.tolist() == [1, 2, 3]
    assert reordered.source_hash != data.source_hash


def test_truncation(files, tokenizer):
    """Samples are cut to max_length; those left with nothing to train on are skipped and listed."""
    full = load_all(files, tokenizer, max_length=4096)
    data = load_all(files, tokenizer, max_length=20)
    kept = {s.sample_id: s for s in data.samples}
    trainable = [s for s in full.samples if s.loss_mask[:20].any()]
    assert sorted(kept) == [s.sample_id for s in trainable]
    assert [u["sample_id"] for u in data.untrainable] == [
        s.sample_id for s in full.samples if not s.loss_mask[:20].any()
    ]
    assert data.untrainable and all(":" in u["where"] for u in data.untrainable)
    assert data.num_truncated == sum(len(s.input_ids) > 20 for s in trainable) > 0
    for before in trainable:
        after = kept[before.sample_id]
        assert after.input_ids.tolist() == before.input_ids[:20].tolist()
        assert after.loss_mask.tolist() == before.loss_mask[:20].tolist()


def test_worker_processes_give_the_same_result(files, tokenizer, monkeypatch):
    monkeypatch.setattr("dflash_cache.data.dataset.CHUNK_RECORDS", 3)  # several chunks in flight
    serial = load_all(files, tokenizer, max_length=64)
    parallel = load_all(files, tokenizer, max_length=64, workers=2)
    assert parallel.num_truncated == serial.num_truncated
    assert [s.sample_id for s in parallel.samples] == [s.sample_id for s in serial.samples]
    for a, b in zip(serial.samples, parallel.samples):
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)


@pytest.mark.parametrize("workers", [0, 2])
def test_out_of_vocabulary_ids(tmp_path, tokenizer, workers, monkeypatch):
    monkeypatch.setattr("dflash_cache.data.dataset.CHUNK_RECORDS", 1)  # two chunks: the pool is used
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + json.dumps({"input_ids": [1, len(tokenizer)]}) + "\n")
    with pytest.raises(DFlashCacheError, match=rf"bad.jsonl:2: token id {len(tokenizer)} at position 1 is outside"):
        load_all([bad], tokenizer, max_length=64, workers=workers)
    pq.write_table(pa.table({"input_ids": [[5, -1]]}), tmp_path / "bad.parquet")
    with pytest.raises(DFlashCacheError, match=r"bad.parquet row 0: token id -1 at position 1 is outside"):
        load_all([tmp_path / "bad.parquet"], tokenizer, max_length=64)


def test_conversations_need_a_chat_template(files):
    no_template = build_tokenizer(chat_template=None)
    with pytest.raises(DFlashCacheError, match=r"conversations.jsonl:1: the tokenizer has no chat template"):
        load_all(files, no_template, max_length=64)
    # pre-tokenized input needs none
    assert len(load_all(files[2:], no_template, max_length=64).samples) == 3


def test_bad_arguments(tmp_path, files, tokenizer):
    with pytest.raises(DFlashCacheError, match="no data files given"):
        load_all([], tokenizer, max_length=64)
    with pytest.raises(DFlashCacheError, match=r"data file .*missing.jsonl does not exist"):
        load_all([files[0], tmp_path / "missing.jsonl"], tokenizer, max_length=64)
    with pytest.raises(DFlashCacheError, match="max length must be at least 1"):
        load_all(files, tokenizer, max_length=0)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DFlashCacheError, match="empty.jsonl is empty"):
        load_all([files[0], tmp_path / "empty.jsonl"], tokenizer, max_length=64)


def mixed_file(tmp_path, tokenizer):
    """Good records with a bad one of each kind between them."""
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    lines = [
        json.dumps(good),  # 1 good
        '{"messages": [',  # 2 malformed JSON
        json.dumps({"messages": [{"role": "user", "content": "no reply"}]}),  # 3 nothing to train on
        json.dumps({"input_ids": [1, len(tokenizer)]}),  # 4 outside the vocabulary
        json.dumps(
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "boom"}]}
        ),  # 5 template error
        json.dumps({"input_ids": [5, 6], "loss_mask": [0, 0]}),  # 6 good line, nothing to train on
        json.dumps({"input_ids": list(range(5, 300))}),  # 7 longer than the byte limit below
        json.dumps(good),  # 8 good
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def failing_tokenizer():
    template = (
        "{%- for m in messages %}{%- if m['content'] == 'boom' %}{{ raise_exception('roles must alternate') }}"
        "{%- endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    return build_tokenizer(chat_template=template)


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_records_stop_or_are_skipped_and_listed(tmp_path, workers, monkeypatch):
    monkeypatch.setattr("dflash_cache.data.dataset.CHUNK_RECORDS", 3)  # several chunks: the pool is used
    tokenizer = failing_tokenizer()
    path = mixed_file(tmp_path, tokenizer)
    options = EncodeOptions(64, max_record_bytes=1000)
    with pytest.raises(DFlashCacheError, match=r"mixed.jsonl:2: not valid JSON"):
        load_all([path], tokenizer, 64, workers=workers, options=options)
    data = load_all([path], tokenizer, 64, workers=workers, options=options, on_bad_record="skip")
    assert [s.sample_id for s in data.samples] == [0, 7]  # ids stay the record index
    assert [(b["where"], b["reason"].split(" (")[0].split(":")[0]) for b in data.bad_records] == [
        (f"{path}:2", "not valid JSON"),
        (f"{path}:3", "the conversation has no assistant turn, so nothing to train on"),
        (
            f"{path}:4",
            f"token id {len(tokenizer)} at position 1 is outside the tokenizer's vocabulary of {len(tokenizer)} ids",
        ),
        (f"{path}:5", "the chat template failed on this conversation"),
        (f"{path}:7", "the line is longer than 1,000 bytes, the limit for this --max-length"),
    ]
    assert data.untrainable == [{"where": f"{path}:6", "sample_id": 5}]
    assert data.report()["bad_records"] == data.bad_records


def test_one_huge_line_costs_little_memory(tmp_path, tokenizer):
    """A 50 MB line is refused without being held: peak Python memory stays near the line limit."""
    import tracemalloc

    path = tmp_path / "huge.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    with open(path, "w") as f:
        f.write(
            json.dumps(
                {"messages": [{"role": "user", "content": "x" * (50 << 20)}, {"role": "assistant", "content": "y"}]}
            )
        )
        f.write("\n" + good + "\n")
    tracemalloc.start()
    try:
        data = load_all([path], tokenizer, 8192, on_bad_record="skip")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [s.sample_id for s in data.samples] == [1]
    assert (
        data.bad_records[0]["where"] == f"{path}:1" and "longer than 4,194,304 bytes" in data.bad_records[0]["reason"]
    )
    assert peak < 16 << 20, peak


def test_a_template_that_leaves_out_a_field_makes_a_bad_record(tmp_path):
    """A template that drops reasoning: an error naming the field, or with --on-bad-record skip a listed
    bad record; never a sample that quietly lacks it."""
    tokenizer = build_tokenizer()  # tests/support/tiny.py's template renders content only
    path = tmp_path / "r.jsonl"
    dropped = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "reasoning_content": "think", "content": "a"},
        ]
    }
    kept = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text(json.dumps(dropped) + "\n" + json.dumps(kept) + "\n")
    reason = (
        "the chat template leaves out what the data has (the template does not render the reasoning of "
        "assistant turn 1): remove it from the record, or skip such records with --on-bad-record skip"
    )
    with pytest.raises(DFlashCacheError) as error:
        load_all([path], tokenizer, 64)
    assert str(error.value) == f"{path}:1: {reason}"
    data = load_all([path], tokenizer, 64, on_bad_record="skip")
    assert data.bad_records == [{"where": f"{path}:1", "reason": reason}]
    assert [s.sample_id for s in data.samples] == [1] and data.unfaithful == 0


def test_masked_token_kinds(tmp_path, tokenizer):
    path = tmp_path / "k.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    assert load_all([path], tokenizer, 64).masked_tokens == {"content": 2, "reasoning": 0, "tool_call": 0, "markup": 0}
