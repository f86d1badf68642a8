"""A record's own `id`: read from every input form, kept through the tokenized data and the shards,
and usable as a cache key beside the sample id; old caches without ids still read."""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

import dflash_cache.data.tokenized as tokenized
from dflash_cache import open_cache
from dflash_cache.data.readers import read_records
from dflash_cache.data.tokenized import tokenized_data
from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.cache import UnknownSample
from dflash_cache.store.inspect import describe_cache
from dflash_cache.store.manifest import manifest_checksum
from dflash_cache_cli.main import main
from tests.cachegen import random_row, random_spec, write_random_cache

OLD_CACHE = Path(__file__).parent / "fixtures" / "cache-v1"  # written by dflash-cache before record ids (format 1)
TALK = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello to you"}]


def write_lines(path: Path, objects) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objects))
    return path


def test_jsonl_ids_of_every_form_are_kept_as_text(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl",
        [
            {"id": "oa-0", "messages": TALK},
            {"id": 7, "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}]},
            {"messages": TALK},
            {"id": None, "input_ids": [1, 2]},
            {"id": -3, "input_ids": [1, 2]},
        ],
    )
    assert [r.record_id for r in read_records(path)] == ["oa-0", "7", None, None, "-3"]


@pytest.mark.parametrize("bad, shown", [(1.5, "1.5"), (True, "True"), ([1], r"\[1\]"), ({"a": 1}, "{'a': 1}")])
def test_an_id_of_another_type_is_a_bad_record_naming_its_line(tmp_path, bad, shown):
    path = write_lines(tmp_path / "d.jsonl", [{"id": "a", "messages": TALK}, {"id": bad, "messages": TALK}])
    with pytest.raises(DFlashCacheError, match=rf"d\.jsonl:2: 'id' must be a string or an integer, found {shown}$"):
        list(read_records(path))
    records = list(read_records(path, skip_bad=True))
    assert records[0].record_id == "a" and "'id' must be a string or an integer" in records[1].reason


def test_an_overlong_id_is_refused(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [{"id": "x" * 1025, "messages": TALK}])
    with pytest.raises(DFlashCacheError, match=r"d\.jsonl:1: 'id' is 1,025 characters long, more than the 1,024"):
        list(read_records(path))


@pytest.mark.parametrize(
    "ids, kind, expected",
    [
        (["a", None, "c"], pa.string(), ["a", None, "c"]),
        ([10, 11, None], pa.int64(), ["10", "11", None]),
        (["x", "y", "z"], pa.large_string(), ["x", "y", "z"]),
    ],
)
def test_parquet_id_column(tmp_path, ids, kind, expected):
    path = tmp_path / "t.parquet"
    pq.write_table(
        pa.table({"input_ids": pa.array([[1], [2, 3], [4]], pa.list_(pa.int32())), "id": pa.array(ids, kind)}), path
    )
    assert [r.record_id for r in read_records(path)] == expected


def test_an_id_column_of_another_type_is_an_error_naming_it(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1]], pa.list_(pa.int32())), "id": pa.array([1.5])}), path)
    with pytest.raises(DFlashCacheError, match="column 'id' must hold strings or integers, found double"):
        list(read_records(path))


def test_tokenized_data_keeps_ids_and_an_old_file_without_them_is_rebuilt(tmp_path, tokenizer, monkeypatch):
    data = write_lines(
        tmp_path / "d.jsonl", [{"id": "oa-0", "messages": TALK}, {"messages": TALK}, {"id": 2, "input_ids": [5, 6, 7]}]
    )
    folder = tmp_path / "tok"
    built = tokenized_data([data], tokenizer, 64, "t" * 64, folder, workers=0)
    store = built.samples(built.sample_ids)
    assert [store[i].record_id for i in (0, 1, 2)] == ["oa-0", None, "2"]
    # Read back as --data (extract does), the file keeps them too.
    assert [r.record_id for r in read_records(built.path)] == ["oa-0", None, "2"]
    # The same file as the format before ids wrote it: not reused, tokenized again.
    table = pa.ipc.open_file(pa.memory_map(str(built.path))).read_all().drop_columns(["id"])
    with pa.OSFile(str(built.path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    calls = []
    real = tokenized.stream_samples
    monkeypatch.setattr(tokenized, "stream_samples", lambda *a: calls.append(1) or real(*a))
    again = tokenized_data([data], tokenizer, 64, "t" * 64, folder, workers=0)
    assert calls == [1] and again.samples([0])[0].record_id == "oa-0"


def test_lookup_by_sample_id_and_by_record_id(tmp_path):
    ids = ["oa-0", "1", None, "oa-3", "b"]
    hidden = write_random_cache(tmp_path / "c", [4, 5, 6, 3, 2], rows_per_shard=2, record_ids=ids)
    cache = open_cache(tmp_path / "c")
    for sid, record_id in enumerate(ids):
        assert cache[sid].record_id == record_id and cache.record_id(sid) == record_id
        if record_id is not None:
            sample = cache[record_id]
            assert sample.sample_id == sid and torch.equal(sample.hidden, hidden[sid])
    assert cache["1"].sample_id == 1 and cache[1].sample_id == 1  # an integer id is looked up as its digits
    assert cache.sample_id(np.int64(3)) == 3 and "oa-3" in cache and 3 in cache and "nope" not in cache
    assert cache.record_ids() == {"oa-0": 0, "1": 1, "oa-3": 3, "b": 4}
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["format_version"] == 2


def test_an_unknown_key_is_one_line_naming_it_and_the_keys_there_are(tmp_path):
    write_random_cache(tmp_path / "c", [4, 5, 6], record_ids=["oa-0", None, "7"])
    cache = open_cache(tmp_path / "c")
    with pytest.raises(UnknownSample) as e:
        cache["oa-9"]
    assert str(e.value) == (
        f"no record id 'oa-9' in {tmp_path / 'c'}: keys are integer sample ids 0..2 (the records' "
        "numbers in the --data files, from 0) and 2 record ids (the records' own `id`, as strings, e.g. 'oa-0')"
    )
    assert isinstance(e.value, KeyError) and isinstance(e.value, DFlashCacheError)
    with pytest.raises(
        UnknownSample, match=r"^no sample 7 in .* \(there is a record id '7': give it as a string\): keys are"
    ):
        cache[7]
    with pytest.raises(
        UnknownSample, match=r"^no record id '2' in .* \(there is a sample id 2: give it as an integer\): keys"
    ):
        cache["2"]
    with pytest.raises(UnknownSample, match=r"^1\.0 is not a key of"):
        cache[1.0]


def test_an_id_several_records_share_names_them_all(tmp_path):
    write_random_cache(tmp_path / "c", [4, 5, 6, 3], record_ids=["0", "1", "0", "x"])  # two files both from 0
    cache = open_cache(tmp_path / "c")
    assert cache["x"].sample_id == 3 and cache["1"].sample_id == 1
    with pytest.raises(
        UnknownSample, match=r"record id '0' is the id of 2 records of .* \(sample ids 0, 2\); look one up by"
    ):
        cache["0"]
    assert cache[0].record_id == cache[2].record_id == "0"
    assert cache.record_ids()["0"] == [0, 2]
    assert any("2 records share an id with another" in line for line in describe_cache(cache, 4096))


def test_a_row_whose_record_id_differs_from_the_manifest_is_caught(tmp_path):
    write_random_cache(tmp_path / "c", [4, 5], record_ids=["a", "b"])
    path = tmp_path / "c" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["shards"][0]["record_ids"] = ["z", "b"]  # an index that no longer says what the rows hold
    manifest["checksum"] = manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(DFlashCacheError, match="row 0 holds record id 'a', the manifest says 'z'"):
        open_cache(tmp_path / "c")["z"]


def test_a_record_id_is_in_the_row_checksum(tmp_path):
    row, _ = random_row(0, 5, random_spec())
    plain = row.checksum()
    row.record_id = "oa-0"
    assert row.checksum() != plain
    assert row.record_batch.column("record_id").to_pylist() == ["oa-0"]


def test_a_cache_of_format_1_reads_without_record_ids(tmp_path):
    shutil.copytree(OLD_CACHE, tmp_path / "old")
    spec = random_spec(layer_ids=(1, 3), hidden_size=16)
    cache = open_cache(tmp_path / "old")
    assert cache.manifest["format_version"] == 1 and len(cache) == 3
    for sid, n in enumerate([5, 7, 3]):
        sample = cache[sid]
        assert sample.record_id is None and torch.equal(sample.hidden, random_row(sid, n, spec)[1])
    with pytest.raises(UnknownSample, match="keys are integer sample ids 0..2 .*; it has no record ids$"):
        cache["oa-0"]
    assert any(line.startswith("record ids:   none") for line in describe_cache(cache, 4096))


@pytest.mark.slow
def test_ids_from_jsonl_and_parquet_through_extract_to_lookup_and_inspect(qwen3_target_dir, tmp_path):
    conversations = write_lines(
        tmp_path / "c.jsonl",
        [
            {"id": "oa-0", "messages": TALK},
            {"id": 1, "messages": TALK},
            {"messages": TALK},
            {"id": "sg-3", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "an answer"}]},
        ],
    )
    tokens = tmp_path / "t.parquet"
    pq.write_table(
        pa.table(
            {"input_ids": pa.array([[5, 6, 7], [8, 9]], pa.list_(pa.int32())), "id": pa.array([100, None], pa.int64())}
        ),
        tokens,
    )
    cache_dir = tmp_path / "cache"
    result = CliRunner().invoke(
        main,
        [
            "extract",
            "--target",
            str(qwen3_target_dir),
            "--data",
            str(conversations),
            "--data",
            str(tokens),
            "--out",
            str(cache_dir),
            "--layers",
            "1",
            "--token-budget",
            "512",
        ],
    )
    assert result.exit_code == 0, result.output
    cache = open_cache(cache_dir)
    assert [cache.record_id(i) for i in range(6)] == ["oa-0", "1", None, "sg-3", "100", None]
    assert cache["oa-0"].sample_id == 0 and cache["sg-3"].sample_id == 3 and cache["100"].sample_id == 4
    assert cache["100"].input_ids.tolist() == [5, 6, 7]
    assert torch.equal(cache["1"].input_ids, cache[1].input_ids) and cache[5].record_id is None
    shown = CliRunner().invoke(main, ["inspect", str(cache_dir)])
    assert "record ids:   4 of 6 samples (e.g. 'oa-0'), each naming one sample" in shown.output
    missing = CliRunner().invoke(main, ["inspect", str(cache_dir), "--record", "oa-9"])
    assert missing.exit_code == 1 and "no record id 'oa-9'" in missing.output and len(missing.output.splitlines()) == 1
    by_id, by_number = (
        CliRunner().invoke(main, ["inspect", str(cache_dir), *key]) for key in (["--record", "sg-3"], ["--sample", "3"])
    )
    assert by_id.exit_code == 0, by_id.output
    assert by_id.output == by_number.output and "sample:       3 (record id 'sg-3')" in by_id.output
