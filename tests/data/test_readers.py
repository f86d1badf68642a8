import json
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_cache.data.readers import Conversation, TokenRecord, read_records
from dflash_cache.errors import DFlashCacheError


def write_lines(path: Path, objects) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objects))
    return path


def token_table(rows, masks=None) -> pa.Table:
    columns = {"input_ids": pa.array(rows, pa.list_(pa.int32()))}
    if masks is not None:
        columns["loss_mask"] = pa.array(masks, pa.list_(pa.bool_()))
    return pa.table(columns)


def test_messages_and_sharegpt_forms(tmp_path):
    path = write_lines(
        tmp_path / "mixed.jsonl",
        [
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "u"},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "",
            {
                "conversations": [
                    {"from": "human", "value": "q"},
                    {"from": "gpt", "value": "r"},
                    {"from": "function", "value": "f"},
                    {"from": "chatgpt", "value": "r2"},
                ],
                "id": "extra keys are ignored",
            },
        ],
    )
    first, second = list(read_records(path))
    assert isinstance(first, Conversation) and first.where == f"{path}:1"
    assert first.messages == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    assert second.where == f"{path}:3"  # the blank line 2 is skipped, line numbers are the file's
    assert [m["role"] for m in second.messages] == ["user", "assistant", "tool", "assistant"]
    assert [m["content"] for m in second.messages] == ["q", "r", "f", "r2"]


def test_pretokenized_jsonl(tmp_path):
    path = write_lines(
        tmp_path / "tok.jsonl", [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, True]}, {"input_ids": [8]}]
    )
    a, b = list(read_records(path))
    assert isinstance(a, TokenRecord)
    assert a.input_ids.tolist() == [5, 6, 7] and a.loss_mask.tolist() == [False, True, True]
    assert b.input_ids.tolist() == [8] and b.loss_mask is None


@pytest.mark.parametrize("kind", ["parquet", "arrow-file", "arrow-stream"])
def test_pretokenized_columnar(tmp_path, kind):
    rows = [[1, 2, 3], [4], [5, 6]]
    table = token_table(rows, [[False, True, True], [True], [True, False]])
    path = tmp_path / "tok.bin"  # the format comes from the bytes, not the name
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=2)
    else:
        opener = pa.ipc.new_file if kind == "arrow-file" else pa.ipc.new_stream
        with opener(str(path), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=2):
                writer.write_batch(batch)
    records = list(read_records(path))
    assert [r.input_ids.tolist() for r in records] == rows
    assert [r.loss_mask.tolist() for r in records] == [[False, True, True], [True], [True, False]]
    assert [r.where for r in records] == [f"{path} row {i}" for i in range(3)]


def test_parquet_without_mask_and_integer_mask(tmp_path):
    pq.write_table(token_table([[1, 2]]), tmp_path / "a.parquet")
    assert next(read_records(tmp_path / "a.parquet")).loss_mask is None
    table = pa.table({"input_ids": [[1, 2]], "loss_mask": pa.array([[0, 2]], pa.list_(pa.int8()))})
    pq.write_table(table, tmp_path / "b.parquet")
    with pytest.raises(DFlashCacheError, match=r"b.parquet row 0: 'loss_mask' holds values other than 0 and 1"):
        list(read_records(tmp_path / "b.parquet"))


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"messages": [', r":2: not valid JSON"),
        ("[1, 2]", r":2: expected a JSON object, found list \(a JSON array file"),
        ('{"messages": [{"role": "wizard", "content": "x"}]}', r":2: messages\[0\] has unknown role 'wizard'"),
        ('{"conversations": [{"from": "bot", "value": "x"}]}', r":2: conversations\[0\] has unknown role 'bot'"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', r":2: the conversation has no assistant turn"),
        ('{"messages": []}', r":2: 'messages' must be a non-empty list"),
        ('{"messages": [{"role": "assistant", "content": null}]}', r":2: messages\[0\].content must be a string"),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, {"role": "assistant", "content": "a"}]}',
            r":2: messages\[0\].content\[0\] is a 'image_url' part; only text parts can be trained on",
        ),
        (
            '{"messages": [{"role": "assistant", "content": "a", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]}',
            r":2: messages\[0\].tool_calls\[0\] arguments is not valid JSON",
        ),
        (
            '{"messages": [{"role": "assistant", "content": "a", "tool_calls": [{"function": {"arguments": "{}"}}]}]}',
            r":2: messages\[0\].tool_calls\[0\] needs a function name",
        ),
        (
            '{"messages": [{"role": "assistant", "content": "a", "reasoning_content": "x", "thinking": "y"}]}',
            r":2: messages\[0\] has different reasoning in reasoning_content and thinking",
        ),
        ('{"text": "hello"}', r":2: a record needs exactly one of .* \(found none\)"),
        ('{"input_ids": [1], "messages": []}', r":2: .*found messages and input_ids"),
        ('{"input_ids": [1, 2.5]}', r":2: 'input_ids' holds 2.5, not an integer"),
        ('{"input_ids": [1, true]}', r":2: 'input_ids' holds True"),
        ('{"input_ids": []}', r":2: 'input_ids' must be a non-empty list"),
        (
            '{"input_ids": [99999999999999999999999]}',
            r":2: 'input_ids' holds 99999999999999999999999, an integer too large",
        ),
        ('{"input_ids": [1, 2], "loss_mask": [1]}', r":2: 'loss_mask' has 1 entries but 'input_ids' has 2"),
        ('{"input_ids": [1, 2], "loss_mask": [1, 2]}', r":2: 'loss_mask' must be a list of 0/1"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, message):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = write_lines(tmp_path / "bad.jsonl", [good, line, good])
    with pytest.raises(DFlashCacheError, match=str(path).replace(".", r"\.") + message):
        list(read_records(path))


def test_invalid_utf8_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"input_ids": [1]}\n{"input_ids": [1]}\xff\n')
    with pytest.raises(DFlashCacheError, match=r"bad.jsonl:2: not valid UTF-8"):
        list(read_records(path))


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_files(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(DFlashCacheError, match="empty|no records"):
        list(read_records(path))


def test_empty_parquet(tmp_path):
    pq.write_table(token_table([]), tmp_path / "empty.parquet")
    with pytest.raises(DFlashCacheError, match="empty.parquet has no records"):
        list(read_records(tmp_path / "empty.parquet"))


def test_missing_file(tmp_path):
    with pytest.raises(DFlashCacheError, match="data file .*nope.jsonl does not exist"):
        list(read_records(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize(
    "table, message",
    [
        (
            pa.table({"input_ids": pa.array([["a", "b"]])}),
            r": column 'input_ids' must be a list of integers, found list<[a-z]+: string>",
        ),
        (pa.table({"input_ids": pa.array([1, 2])}), r": column 'input_ids' must be a list of integers, found int64"),
        (
            pa.table({"input_ids": [[1]], "loss_mask": pa.array([[0.5]])}),
            r": column 'loss_mask' must be a list of integers or booleans, found list<[a-z]+: double>",
        ),
        (pa.table({"text": ["hi"]}), r": no 'input_ids' column \(columns: text\)"),
        (pa.table({"input_ids": pa.array([[1], None], pa.list_(pa.int64()))}), r" row 1: 'input_ids' is null"),
        (
            pa.table({"input_ids": pa.array([[1], [2, None]], pa.list_(pa.int64()))}),
            r" row 1: 'input_ids' holds a null value",
        ),
        (pa.table({"input_ids": pa.array([[1], []], pa.list_(pa.int64()))}), r" row 1: 'input_ids' is empty"),
        (
            pa.table({"input_ids": [[1, 2]], "loss_mask": [[True]]}),
            r" row 0: 'loss_mask' has 1 entries but 'input_ids' has 2",
        ),
    ],
)
def test_bad_parquet(tmp_path, table, message):
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    with pytest.raises(DFlashCacheError, match=r"bad\.parquet" + message):
        list(read_records(path))


def test_truncated_parquet_and_arrow(tmp_path):
    table = token_table([list(range(50))] * 20)
    pq.write_table(table, tmp_path / "t.parquet")
    with pa.ipc.new_file(str(tmp_path / "t.arrow"), table.schema) as writer:
        writer.write_table(table)
    for name in ("t.parquet", "t.arrow"):
        data = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(data[: len(data) // 2])
        with pytest.raises(DFlashCacheError, match=f"{name}: not a readable"):
            list(read_records(tmp_path / name))


# Lines that are mostly near-valid records of each form, with arbitrary JSON and raw bytes mixed in.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)
role = st.sampled_from(["user", "assistant", "system", "tool", "wizard"]) | json_values
message = st.fixed_dictionaries({"role": role, "content": st.text(max_size=8) | json_values})
sharegpt_turn = st.fixed_dictionaries(
    {"from": st.sampled_from(["human", "gpt", "function", "bot"]), "value": st.text(max_size=8)}
)
token_id = st.integers(-5, 500) | st.integers() | st.floats() | st.booleans()
record = (
    st.fixed_dictionaries({"messages": st.lists(message, max_size=3)})
    | st.fixed_dictionaries({"conversations": st.lists(sharegpt_turn, max_size=3)})
    | st.fixed_dictionaries(
        {"input_ids": st.lists(token_id, max_size=4)},
        optional={"loss_mask": st.lists(st.sampled_from([0, 1, 2, True, False, 0.5]), max_size=4)},
    )
    | st.dictionaries(
        st.sampled_from(["messages", "conversations", "input_ids", "loss_mask", "x"]), json_values, max_size=3
    )
)
line = record.map(json.dumps) | json_values.map(json.dumps) | st.text(max_size=20) | st.binary(max_size=20)


@settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(line, max_size=3))
def test_fuzz_jsonl_reader(lines):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fuzz.jsonl"
        path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode("utf-8", "surrogatepass") for x in lines))
        try:
            records = list(read_records(path))
        except DFlashCacheError as e:
            assert "\n" not in str(e)
            return
        for r in records:
            assert isinstance(r, (Conversation, TokenRecord))
            if isinstance(r, TokenRecord):
                assert r.input_ids.dtype == np.int64 and len(r.input_ids) > 0


def test_message_fields(tmp_path):
    """Reasoning, tool calls (arguments as objects or JSON strings, content null or absent), tool
    results, text parts and a tools list reach the template; developer and ipython roles are mapped."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    path = write_lines(
        tmp_path / "fields.jsonl",
        [
            {
                "messages": [
                    {
                        "role": "developer",
                        "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                    },
                    {"role": "user", "content": "2+3?"},
                    {
                        "role": "assistant",
                        "reasoning_content": "Add.",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "add", "arguments": '{"a": 2,"b": 3}'},
                            }
                        ],
                    },
                    {"role": "ipython", "tool_call_id": "c1", "name": "add", "content": "5"},
                    {"role": "assistant", "thinking": "Done.", "tool_calls": [{"name": "add", "arguments": {"a": 1}}]},
                    {"role": "assistant", "reasoning": "r", "content": "5"},
                ],
                "tools": tools,
            }
        ],
    )
    (record,) = read_records(path)
    system, user, call, result, flat, last = record.messages
    assert system == {"role": "system", "content": "Be brief."}
    assert call["content"] is None and call["reasoning_content"] == call["thinking"] == "Add."
    (c,) = call["tool_calls"]
    assert c["id"] == "c1" and c["type"] == "function" and c["function"]["name"] == "add"
    assert c["function"]["arguments"] == {"a": 2, "b": 3} and str(c["function"]["arguments"]) == '{"a": 2,"b": 3}'
    assert result == {"role": "tool", "content": "5", "tool_call_id": "c1", "name": "add"}
    assert flat["content"] is None and flat["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1}}
    assert str(flat["tool_calls"][0]["function"]["arguments"]) == '{"a": 1}'
    assert last == {"role": "assistant", "content": "5", "reasoning_content": "r", "thinking": "r"}
    assert record.tools == tools


def test_sharegpt_fields(tmp_path):
    """ShareGPT rows (LLaMA-Factory's form too: system, tools as JSON, function_call, observation)."""
    tools = [{"name": "add", "parameters": {}}]
    path = write_lines(
        tmp_path / "sharegpt.jsonl",
        [
            {
                "system": "Be brief.",
                "tools": json.dumps(tools),
                "conversations": [
                    {"from": "human", "value": "2+3?"},
                    {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2}}'},
                    {"from": "observation", "value": "5"},
                    {"from": "gpt", "value": "5", "reasoning_content": "Added."},
                ],
            }
        ],
    )
    (record,) = read_records(path)
    assert [m["role"] for m in record.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert record.messages[0]["content"] == "Be brief."
    assert record.messages[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2}}
    assert record.messages[4]["reasoning_content"] == "Added."
    assert record.tools == tools


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"input_ids": [1, 2]}).encode() + b"\n")
    assert [r.input_ids.tolist() for r in read_records(path)] == [[1, 2]]


def test_gzip_jsonl_is_read(tmp_path):
    import gzip

    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"input_ids": [1]}\n{"input_ids": [2, 3]}\n'))
    assert [r.input_ids.tolist() for r in read_records(path)] == [[1], [2, 3]]
    path.write_bytes(gzip.compress(b'{"input_ids": [1]}\n' * 100)[:40])  # cut short
    with pytest.raises(DFlashCacheError, match=r"data.jsonl.gz: unreadable gzip data"):
        list(read_records(path))


def test_a_pipe_as_data_is_named_as_such(tmp_path):
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(
        DFlashCacheError, match=r"data file .*pipe is a pipe \(a FIFO or <\(\.\.\.\)\), which can be read only once"
    ):
        list(read_records(fifo))
    with pytest.raises(DFlashCacheError, match=r"is a directory"):
        list(read_records(tmp_path))


def test_uint64_ids_above_2_63_are_printed_as_they_are(tmp_path):
    big = 2**63 + 5
    pq.write_table(pa.table({"input_ids": pa.array([[1, big]], pa.list_(pa.uint64()))}), tmp_path / "big.parquet")
    with pytest.raises(DFlashCacheError, match=rf"big.parquet row 0: token id {big} at position 1 is too large"):
        list(read_records(tmp_path / "big.parquet"))


def test_oversized_line_is_refused_unread(tmp_path):
    path = tmp_path / "big.jsonl"
    small = json.dumps({"input_ids": [1, 2]})
    huge = json.dumps({"input_ids": [7] * 200_000})  # 600 KB on one line
    path.write_text("\n".join([small, huge, small]) + "\n")
    with pytest.raises(DFlashCacheError, match=r"big.jsonl:2: the line is longer than 10,000 bytes"):
        list(read_records(path, max_line_bytes=10_000))
    records = list(read_records(path, skip_bad=True, max_line_bytes=10_000))
    assert [type(r).__name__ for r in records] == ["TokenRecord", "BadRecord", "TokenRecord"]
    assert records[1].where == f"{path}:2" and records[1].reason.startswith("the line is longer than 10,000 bytes")
    assert records[2].where == f"{path}:3"
