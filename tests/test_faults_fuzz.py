"""Fuzzing the readers that take files from outside (a fixed, derandomized set of cases): Parquet and
Arrow pre-tokenized input, the cache manifest, shard bytes and the journals. Each either works or
raises DFlashCacheError with a one-line message, never another exception; and a damaged shard never
yields data other than what was written."""

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.data.readers import TokenRecord, read_records
from dflash_cache.store.manifest import manifest_checksum, read_journals
from tests.cachegen import write_random_cache

FUZZ = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def one_line(error: DFlashCacheError) -> None:
    assert str(error) and "\n" not in str(error), str(error)


# --- Parquet / Arrow pre-tokenized input ------------------------------------------------------

scalar_types = st.sampled_from(
    [pa.int8(), pa.int32(), pa.int64(), pa.uint8(), pa.uint64(), pa.bool_(), pa.float32(), pa.string(), pa.null()]
)
list_types = st.sampled_from([pa.list_, pa.large_list, lambda t: pa.list_(t, 2)])  # list, large list, fixed size
token_types = st.sampled_from([pa.int32(), pa.int64(), pa.int16(), pa.uint32()]).map(pa.list_)
mask_types = st.sampled_from([pa.bool_(), pa.int8(), pa.uint8()]).map(pa.list_)
any_types = st.one_of(
    scalar_types,
    st.builds(lambda make, t: make(t), list_types, scalar_types),
    scalar_types.map(lambda t: pa.list_(pa.list_(t))),
    scalar_types.map(lambda t: pa.struct([("x", t)])),
)


@st.composite
def columns(draw, kind: pa.DataType, rows: int) -> pa.Array:
    """`rows` values of `kind`: lists of small, negative or huge integers (or flags), with nulls."""
    token = st.sampled_from(["ok"] * 8 + ["odd"]).flatmap(
        lambda kind: st.integers(0, 400) if kind == "ok" else st.none() | st.integers(-5, 1 << 40)
    )
    row = st.sampled_from(["ok"] * 8 + ["odd"]).flatmap(
        lambda kind: st.lists(token, min_size=1, max_size=4) if kind == "ok" else st.none() | st.just([])
    )
    values = draw(st.lists(row, min_size=rows, max_size=rows))
    flags = pa.types.is_list(kind) and pa.types.is_boolean(kind.value_type)
    values = [v if v is None else [x if x is None or not flags else bool(x % 2) for x in v] for v in values]
    try:
        return pa.array(values, kind)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, OverflowError):
        return pa.nulls(rows, kind)


@st.composite
def arrow_tables(draw) -> pa.Table:
    """Mostly near-valid token tables (input_ids, maybe loss_mask) with odd types, values and nulls."""
    rows = draw(st.integers(0, 4))
    table = {}
    if draw(st.integers(0, 9)):
        table["input_ids"] = draw(columns(draw(token_types if draw(st.integers(0, 3)) else any_types), rows))
    if draw(st.booleans()):
        table["loss_mask"] = draw(columns(draw(mask_types if draw(st.integers(0, 3)) else any_types), rows))
    if draw(st.integers(0, 3)) == 0:
        table["text"] = draw(columns(draw(any_types), rows))
    return pa.table(table) if table else pa.table({"text": pa.nulls(rows)})


@FUZZ
@given(
    table=arrow_tables(),
    form=st.sampled_from(["parquet", "arrow-file", "arrow-stream"]),
    damage=st.sampled_from(["none", "none", "flip", "cut"]),
    where=st.floats(0, 1),
    bit=st.integers(0, 7),
)
# pyarrow 26 decodes a Parquet file's column paths as it opens it: a damaged name raised UnicodeDecodeError there
@example(
    table=pa.table({"input_ids": pa.array([[]], pa.list_(pa.int32()))}),
    form="parquet",
    damage="flip",
    where=0.171875,
    bit=7,
)
def test_fuzz_columnar_reader(table, form, damage, where, bit):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "data.bin"
        if form == "parquet":
            pq.write_table(table, path)
        else:
            opener = pa.ipc.new_file if form == "arrow-file" else pa.ipc.new_stream
            with opener(str(path), table.schema) as writer:
                writer.write_table(table)
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[int(where * (len(data) - 1))] ^= 1 << bit
        elif damage == "cut":
            data = data[: int(where * len(data))]
        path.write_bytes(bytes(data))
        try:
            records = list(read_records(path))
        except DFlashCacheError as e:
            one_line(e)
            return
    for record in records:
        assert isinstance(record, TokenRecord) and record.input_ids.dtype == np.int64 and len(record.input_ids) > 0
        assert record.loss_mask is None or (
            record.loss_mask.dtype == bool and len(record.loss_mask) == len(record.input_ids)
        )


# --- the cache: manifest, shards, journals ----------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz") / "cache"
    write_random_cache(root, [5, 17, 9, 30, 12], rows_per_shard=2)
    return root


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 1 << 70) | st.floats() | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)


def leaves(obj, path=()):
    """Every (key path) in a JSON object, inner nodes included."""
    yield path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for key, value in items:
        yield from leaves(value, (*path, key))


@st.composite
def edited_manifests(draw, manifest: dict) -> dict:
    """The manifest with a few parts replaced by arbitrary JSON or deleted, checksum recomputed: what
    a careless hand edit (or a buggy writer) produces, past the checksum."""
    manifest = json.loads(json.dumps(manifest))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from([p for p in leaves(manifest) if p and p[0] != "checksum"]))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
    manifest["checksum"] = manifest_checksum(manifest)
    return manifest


def read_everything(root: Path) -> dict:
    cache = open_cache(root)
    try:
        return {sid: cache[sid] for sid in cache}
    finally:
        cache.close()


@FUZZ
@given(data=st.data())
def test_fuzz_manifest_reader(cache, data):
    manifest = json.loads((cache / "manifest.json").read_text())
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory) / "cache"
        shutil.copytree(cache, root)
        (root / "manifest.json").write_text(json.dumps(data.draw(edited_manifests(manifest))))
        try:
            read_everything(root)
        except DFlashCacheError as e:
            one_line(e)


@FUZZ
@given(where=st.floats(0, 1), bit=st.integers(0, 7))
def test_any_flip_in_the_manifest_is_refused(cache, where, bit):
    data = bytearray((cache / "manifest.json").read_bytes())
    data[int(where * (len(data) - 1))] ^= 1 << bit
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory) / "cache"
        shutil.copytree(cache, root)
        (root / "manifest.json").write_bytes(bytes(data))
        with pytest.raises(DFlashCacheError) as info:
            open_cache(root)
        one_line(info.value)


@FUZZ
@given(
    shard=st.integers(0, 2),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 7)), min_size=1, max_size=3),
    cut=st.none() | st.floats(0, 1),
)
def test_fuzz_shard_bytes_never_yield_wrong_data(cache, shard, flips, cut):
    """What the reader returns from a damaged shard is either an error or exactly what was written
    (a flip in bytes that hold no data, such as padding, changes nothing)."""
    original = read_everything(cache)
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory) / "cache"
        shutil.copytree(cache, root)
        path = root / "shards" / f"r0-{shard:05d}.arrow"
        data = bytearray(path.read_bytes())
        for where, bit in flips:
            data[int(where * (len(data) - 1))] ^= 1 << bit
        path.write_bytes(bytes(data if cut is None else data[: int(cut * len(data))]))
        try:
            samples = read_everything(root)
        except DFlashCacheError as e:
            one_line(e)
            return
    for sid, sample in samples.items():
        expected = original[sid]
        for name in ("input_ids", "loss_mask", "target_ids"):
            assert torch.equal(getattr(sample, name), getattr(expected, name))
        assert torch.equal(sample.hidden.view(torch.int16), expected.hidden.view(torch.int16))


journal_lines = st.one_of(
    json_values.map(lambda v: json.dumps({"shard": v})),
    json_values.map(lambda v: json.dumps({"skipped": v})),
    json_values.map(lambda v: json.dumps({"spec": v})),
    json_values.map(lambda v: json.dumps({"target_files": v})),
    json_values.map(json.dumps),
    st.text(max_size=30),
)


@FUZZ
@given(cut=st.integers(0, 10), extra=st.lists(journal_lines, max_size=3), at=st.integers(0, 10))
def test_fuzz_journal_reader(cache, cut, extra, at):
    lines = (cache / "journal" / "r0.jsonl").read_text().splitlines()
    lines = lines[: len(lines) - cut % len(lines)]
    lines[at % (len(lines) + 1) : at % (len(lines) + 1)] = extra
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        (root / "journal").mkdir()
        (root / "journal" / "r0.jsonl").write_text("\n".join(lines) + "\n")
        try:
            state = read_journals(root)
        except DFlashCacheError as e:
            one_line(e)
            return
    assert all(isinstance(sid, int) for sid in state.done_sample_ids())
