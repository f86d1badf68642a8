"""The files kept beside the tokenized data for the front end: the extraction plan
(data/plan_file.py), which a later process (another rank) maps from the file equal to the plan the
planning code makes in memory, and the index of sample ids and lengths (data/tokenized.py). A
damaged or foreign file of either is never used."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_cache.data.plan import Batches
from dflash_cache.data.plan_file import kept_plan
from dflash_cache.data.tokenized import _batch_index, tokenized_data
from dflash_cache.extract.buckets import BucketLayout
from dflash_cache.extract.packing import PackedLayout

TOKENIZER_HASH = "p" * 64


@pytest.fixture
def data_file(tmp_path, tokenizer):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 200, 700)
    rows = [rng.integers(0, len(tokenizer), n).tolist() for n in lengths]
    masks = [(rng.random(n) < 0.7).tolist() for n in lengths]
    for m in masks:
        m[-1] = True  # something to train on
    ids = [None if i % 3 == 0 else f"rec-{i}-é" if i % 3 == 1 else "" for i in range(len(rows))]
    path = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"input_ids": rows, "loss_mask": masks, "id": ids}), path)
    return path


def load(data_file, tokenizer, folder):
    return tokenized_data([data_file], tokenizer, 256, TOKENIZER_HASH, folder, workers=0)


@pytest.mark.parametrize("layout", [PackedLayout(600), BucketLayout(600, 256)])
def test_the_plan_another_process_maps_is_the_plan_made_in_memory(data_file, tokenizer, tmp_path, layout, monkeypatch):
    folder = tmp_path / "tok"
    data = load(data_file, tokenizer, folder)
    # The reference: the planning code on plain arrays, in this process.
    reference = layout.plan(np.array(data.sample_ids), np.array(data.lengths))
    assert len(reference) > 20
    assert kept_plan(data, layout) == reference  # made here, written, read back
    # Another process opening the same data: the plan comes from the file, mapped, not planned again.
    monkeypatch.setattr(type(layout), "plan", lambda *a: pytest.fail("planned again"))
    other = kept_plan(load(data_file, tokenizer, folder), layout)
    assert not other.ids.flags.writeable and other == reference  # a view of the read-only map, not a copy
    assert other[3::8] == [list(b) for b in reference][3::8]  # a rank's share, as lists


def test_another_layout_or_data_gets_its_own_plan(data_file, tokenizer, tmp_path):
    data = load(data_file, tokenizer, tmp_path / "tok")
    a, b = kept_plan(data, PackedLayout(600)), kept_plan(data, PackedLayout(900))
    assert a == PackedLayout(600).plan(np.array(data.sample_ids), np.array(data.lengths)) and a != b
    assert len(list((tmp_path / "tok").glob(f"{data.key}.plan-*.npy"))) == 2


def damaged(path, data):
    """Ways a plan file can be wrong, each written over the good one."""
    good = np.load(path)
    batches, n = int(good[0]), len(data.sample_ids)
    starts, ids = good[1 : batches + 2], good[batches + 2 :]
    twice = ids.copy()
    twice[5] = twice[6]  # a sample twice, another never
    foreign = ids.copy()
    foreign[0] = int(data.sample_ids.max()) + 1  # an id the data does not hold
    empty_batch = starts.copy()
    empty_batch[2] = empty_batch[1]
    yield "cut", path.read_bytes()[:200]
    yield "empty", b""
    yield from [
        ("a sample twice", np.concatenate([[batches], starts, twice])),
        ("a foreign id", np.concatenate([[batches], starts, foreign])),
        ("an empty batch", np.concatenate([[batches], empty_batch, ids])),
        ("a batch count that does not fit", np.concatenate([[batches + 1], starts, ids])),
        ("int32", good.astype(np.int32)),
        ("2-D", good.reshape(1, -1)),
        ("big-endian", good.astype(">i8")),
        ("of other data", good[:-1]),
    ]
    assert n == len(ids)
    yield "pickled objects", np.array([{"x": 1}] * 4, dtype=object)


def test_a_damaged_or_foreign_plan_file_is_made_again(data_file, tokenizer, tmp_path):
    data = load(data_file, tokenizer, tmp_path / "tok")
    layout = PackedLayout(600)
    reference = layout.plan(np.array(data.sample_ids), np.array(data.lengths))
    kept_plan(data, layout)
    path = next((tmp_path / "tok").glob(f"{data.key}.plan-*.npy"))
    for name, bad in list(damaged(path, data)):
        if isinstance(bad, bytes):
            path.write_bytes(bad)
        else:
            np.save(path, bad, allow_pickle=True)
        assert kept_plan(data, layout) == reference, name
        assert np.load(path, allow_pickle=False).dtype == np.dtype("<i8"), name  # written again


def test_rebuilding_the_tokenized_data_drops_its_plans_and_index(data_file, tokenizer, tmp_path):
    folder = tmp_path / "tok"
    data = load(data_file, tokenizer, folder)
    kept_plan(data, PackedLayout(600))
    data.path.with_suffix(".json").unlink()  # a build that died before its JSON: built again
    again = load(data_file, tokenizer, folder)
    assert not list(folder.glob(f"{data.key}.plan-*.npy"))
    assert np.array_equal(again.lengths, data.lengths) and isinstance(again.lengths, np.memmap)
    assert isinstance(kept_plan(again, PackedLayout(600)), Batches)


def test_the_index_is_made_when_missing_and_again_when_damaged(data_file, tokenizer, tmp_path):
    folder = tmp_path / "tok"
    data = load(data_file, tokenizer, folder)
    # The reference: the Arrow file's own columns, read by pyarrow.
    table = pa.ipc.open_file(pa.memory_map(str(data.path))).read_all().to_pydict()
    ids, lengths = table["sample_id"], [len(x) for x in table["input_ids"]]
    assert len(ids) == 700 and {None, ""} < set(table["id"])
    index = folder / f"{data.key}.index.npy"
    good = np.load(index)
    swapped = good.copy()
    swapped[0, [3, 4]] = swapped[0, [4, 3]]  # ids out of order
    zero = good.copy()
    zero[1, 9] = 0  # a sample of no tokens
    outside = good.copy()
    outside[2, 5] = data.path.stat().st_size  # tokens past the end of the file
    for bad in [None, b"", good[:, :-1], good.astype(np.int32), swapped, zero, outside, good.T.copy(), good[:2]]:
        if bad is None:
            index.unlink()  # a folder kept by a version that wrote no index
        elif isinstance(bad, bytes):
            index.write_bytes(bad)
        else:
            np.save(index, bad)
        again = load(data_file, tokenizer, folder)
        assert isinstance(again.sample_ids, np.memmap) and again.sample_ids.tolist() == ids
        assert again.lengths.tolist() == lengths and np.array_equal(np.load(index), good)
    # Every sample, read at the places the index gives, is the file's row.
    store = again.samples(ids)
    for row, sid in enumerate(ids):
        sample = store[sid]
        assert (
            sample.input_ids.tolist() == table["input_ids"][row]
            and sample.loss_mask.tolist() == table["loss_mask"][row]
        )
        assert sample.record_id == table["id"][row]


def test_places_in_files_over_4_gb(data_file, tokenizer, tmp_path):
    """The index's offsets past what Arrow's int32 offsets hold: as if the file's buffers lay 2**40 bytes in."""
    data = load(data_file, tokenizer, tmp_path / "tok")
    batch = pa.ipc.open_file(pa.memory_map(str(data.path))).get_batch(0)
    near, far = _batch_index(batch, 0), _batch_index(batch, -(1 << 40))
    assert np.array_equal(far[2] - near[2], np.full(batch.num_rows, 1 << 40))
    assert np.array_equal(far[3] - near[3], np.full(batch.num_rows, 8 << 40))
    has_id = near[4] >= 0
    assert np.array_equal((far[4] - near[4])[has_id], np.full(has_id.sum(), 1 << 40)) and np.all(far[4][~has_id] == -1)


def test_a_plan_that_cannot_be_written_is_one_line_naming_the_folder_and_its_free_space(
    data_file, tokenizer, tmp_path, monkeypatch
):
    import errno

    from dflash_cache.data import plan_file
    from dflash_cache.errors import DFlashCacheError

    data = load(data_file, tokenizer, tmp_path / "tok")

    def full(path, batches):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plan_file, "_write", full)
    with pytest.raises(DFlashCacheError) as refused:
        kept_plan(data, PackedLayout(600))
    message = str(refused.value)
    assert message.startswith(f"writing the plan failed: No space left on device; free space in {tmp_path / 'tok'} (")
    assert message.endswith("and rerun, or keep the tokenized data elsewhere with --tokenized-dir DIR")
    assert "\n" not in message
