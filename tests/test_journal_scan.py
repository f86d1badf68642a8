"""What a starting extraction rank reads of the journals (store/manifest.py scan_journals): a bit a
data row for "done" and only the paths it may delete, equal to what the journals' whole records
(read_journals) say, on journals written by hand; and the bit set it keeps them in (data/rowbits.py)."""

import json

import numpy as np
import pytest

from dflash_cache.data.rowbits import RowBits
from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.manifest import read_journals, scan_journals

SPEC = {"codec": "bf16", "layer_ids": [1]}
DATA_IDS = [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 12]  # the samples the tokenized data holds (4 and 11 left out)


def rows_of(ids):
    where = {sid: row for row, sid in enumerate(DATA_IDS)}
    return np.array([where.get(int(i), -1) for i in ids], dtype=np.int64)


def shard(path, ids):
    return {
        "shard": {
            "path": path,
            "rows": len(ids),
            "tokens": 2 * len(ids),
            "bytes": 10,
            "hidden_bytes": 8,
            "sha256": "0" * 64,
            "sample_ids": ids,
            "num_tokens": [2] * len(ids),
        }
    }


def write(root, journals):
    (root / "journal").mkdir(parents=True)
    for name, entries in journals.items():
        (root / "journal" / name).write_text("".join(json.dumps(e) + "\n" for e in [{"spec": SPEC}, *entries]))
    return root


PATHS = [
    "shards/r0-00000.arrow",
    "shards/r0-00001.arrow",
    "shards/r1-00000.arrow",
    "shards/r1-00002.arrow",
    "shards/r1-00001.arrow",
    "shards/r1-2.arrow",
    "shards/r2-00000.arrow",
    "shards/x.arrow",
]


def committed(scan):
    return {p for p in PATHS if p in scan.committed}


def done_ids(scan):
    return {sid for row, sid in enumerate(DATA_IDS) if scan.done.has(np.array([row]))[0]}


WRITER_ORDER = {
    "r0.jsonl": [
        shard("shards/r0-00000.arrow", [0, 1, 2]),
        shard("shards/r0-00001.arrow", [5, 6]),
        {"skipped": {"sample_id": 9, "reason": "nan"}},
        {"target_files": {"config.json": "a" * 64}},
    ],
    "r1.jsonl": [shard("shards/r1-00000.arrow", [3]), shard("shards/r1-00002.arrow", [7, 100])],  # 100: not in the data
}


def test_journals_as_the_writer_writes_them(tmp_path):
    root = write(tmp_path / "cache", WRITER_ORDER)
    scan = scan_journals(root, rows_of, len(DATA_IDS), ranks=[1])
    assert scan.spec == SPEC and scan.target_files == {"config.json": "a" * 64}
    assert done_ids(scan) == {0, 1, 2, 3, 5, 6, 7, 9}
    assert scan.done.count() == 8 and scan.done.total(np.array([10 * sid for sid in DATA_IDS])) == 330
    assert committed(scan) == {"shards/r1-00000.arrow", "shards/r1-00002.arrow"}
    assert scan.next_index == {0: 2, 1: 3}
    everyone = scan_journals(root, rows_of, len(DATA_IDS))
    assert committed(everyone) == {
        "shards/r0-00000.arrow",
        "shards/r0-00001.arrow",
        "shards/r1-00000.arrow",
        "shards/r1-00002.arrow",
    }
    # The same as the whole records say.
    state = read_journals(root)
    assert done_ids(everyone) == set(state.done_ids().tolist()) & set(DATA_IDS)
    assert committed(everyone) == {s.path for s in state.shards}


@pytest.mark.parametrize(
    "case",
    [
        "listed twice",
        "in another rank's journal",
        "not a rank's journal name",
        "indices going down",
        "not the writer's shard name",
    ],
)
def test_journals_not_in_writer_order_read_as_their_whole_records_say(tmp_path, case):
    journals = {name: list(entries) for name, entries in WRITER_ORDER.items()}
    expected_done, expected_next = {0, 1, 2, 3, 5, 6, 7, 9}, {0: 2, 1: 3}
    if case == "listed twice":  # the last listing of a path counts: 1 and 2 are not done
        journals["r0.jsonl"].append(shard("shards/r0-00000.arrow", [0]))
        expected_done -= {1, 2}
    elif case == "in another rank's journal":
        journals["r0.jsonl"].append(shard("shards/r1-00005.arrow", [8]))
        expected_done, expected_next = expected_done | {8}, {0: 2, 1: 6}
    elif case == "not a rank's journal name":
        journals["r01.jsonl"] = journals.pop("r1.jsonl")
    elif case == "not the writer's shard name":  # index 3 by its digits, yet not the path shards/r1-00003.arrow
        journals["r1.jsonl"].append(shard("shards/r1-3.arrow", [8]))
        expected_done, expected_next = expected_done | {8}, {0: 2, 1: 4}
    else:
        journals["r0.jsonl"].reverse()
    root = write(tmp_path / "cache", journals)
    scan = scan_journals(root, rows_of, len(DATA_IDS), ranks=[1])
    assert done_ids(scan) == expected_done and scan.next_index == expected_next
    assert done_ids(scan) == set(read_journals(root).done_ids().tolist()) & set(DATA_IDS)
    assert committed(scan) == {s.path for s in read_journals(root).shards} & set(PATHS)


def test_a_corrupt_entry_is_the_same_error_as_for_the_whole_read(tmp_path):
    root = write(tmp_path / "cache", {"r0.jsonl": [shard("shards/r0-00000.arrow", [0, -1])]})
    with pytest.raises(DFlashCacheError, match=r"r0.jsonl: corrupt entry .*wrong type") as whole:
        read_journals(root)
    with pytest.raises(DFlashCacheError) as scanned:
        scan_journals(root, rows_of, len(DATA_IDS))
    assert str(scanned.value) == str(whole.value)


def test_row_bits_against_a_set():
    rng = np.random.default_rng(0)
    bits, reference = RowBits(1001), set()
    values = rng.integers(0, 50, 1001)
    for _ in range(20):
        rows = rng.integers(0, 1001, 60)  # repeats within a call and across calls
        new = bits.add(rows)
        expected_new = []
        for r in rows.tolist():
            expected_new.append(r not in reference)
            reference.add(r)
        assert new.tolist() == expected_new
    assert bits.count() == len(reference)
    assert bits.has(np.arange(1001)).tolist() == [r in reference for r in range(1001)]
    assert bits.total(values) == sum(int(values[r]) for r in reference)
    with pytest.raises(ValueError):
        bits.add(np.array([1001]))
