"""The tokenized-data cache: equal to tokenizing directly, built once, reused, read lazily per rank."""

import hashlib
import json
import pickle
import subprocess
import sys
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dflash_cache.data.tokenized as tokenized
from dflash_cache.data.readers import read_records
from dflash_cache.data.tokenized import tokenized_data
from dflash_cache.errors import DFlashCacheError
from tests.support.tiny import load_all, write_conversations
from tests.support.tokenized import rewrite_ids

TOKENIZER_HASH = "t" * 64


@pytest.fixture
def files(tmp_path, conversations):
    tokens = tmp_path / "tokens.parquet"
    pq.write_table(
        pa.table({"input_ids": [[1, 2, 3], list(range(10, 60)), [7]], "loss_mask": [[0, 1, 1], [1] * 50, [1]]}), tokens
    )
    more = write_conversations(tmp_path / "more.jsonl", count=300, seed=5)  # more than one chunk of 256
    return [conversations, tokens, more]


def as_lists(samples):
    return [(s.sample_id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples]


def test_equals_direct_tokenization_in_parallel_and_is_read_back_by_extract_data(files, tokenizer, tmp_path):
    direct = load_all(files, tokenizer, max_length=40)
    data = tokenized_data(files, tokenizer, 40, TOKENIZER_HASH, tmp_path / "tok", workers=2)
    assert data.sample_ids.tolist() == [s.sample_id for s in direct.samples]
    assert data.lengths.tolist() == [len(s.input_ids) for s in direct.samples]
    assert data.info.num_truncated == direct.num_truncated > 0
    assert data.info.report() == direct.report()
    assert data.source_hash == hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    store = data.samples(data.sample_ids)
    assert as_lists(store[i] for i in data.sample_ids.tolist()) == as_lists(direct.samples)
    # The kept file is pre-tokenized input that --data reads, record i being sample i.
    again = [(r.input_ids.tolist(), r.loss_mask.tolist()) for r in read_records(data.path)]
    assert again == [(s.input_ids.tolist(), s.loss_mask.tolist()) for s in direct.samples]


def test_built_once_then_reused_and_rebuilt_when_an_input_changes(files, tokenizer, tmp_path, monkeypatch):
    folder = tmp_path / "tok"
    first = tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, folder, workers=0)
    monkeypatch.setattr(tokenized, "stream_samples", lambda *a: pytest.fail("tokenized again"))
    monkeypatch.setattr(tokenized, "hash_files", lambda *a: pytest.fail("hashed again"))
    again = tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, folder, workers=0)
    assert again.path == first.path and np.array_equal(again.lengths, first.lengths)
    monkeypatch.undo()
    built = []
    real = tokenized.stream_samples
    monkeypatch.setattr(tokenized, "stream_samples", lambda *a: built.append(1) or real(*a))
    others = [
        tokenized_data(files, tokenizer, 32, TOKENIZER_HASH, folder, workers=0),  # another max_length
        tokenized_data(files, tokenizer, 64, "u" * 64, folder, workers=0),
    ]  # another tokenizer
    with open(files[2], "a") as f:
        f.write(
            json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n"
        )
    others.append(tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, folder, workers=0))  # data changed
    assert len(built) == 3 and len({d.path for d in [first, *others]}) == 4
    assert len(others[-1].lengths) == len(first.lengths) + 1


def test_an_unfinished_or_damaged_file_is_built_again(files, tokenizer, tmp_path):
    folder = tmp_path / "tok"
    data = tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, folder, workers=0)
    data.path.write_bytes(data.path.read_bytes()[:100])  # cut: its JSON no longer vouches for it
    rebuilt = tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, folder, workers=0)
    assert np.array_equal(rebuilt.lengths, data.lengths)
    data.path.with_suffix(".json").unlink()  # a build that died before its JSON
    assert np.array_equal(tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, folder, workers=0).lengths, data.lengths)


def test_a_rank_store_holds_only_its_ids_and_pickles_without_samples(files, tokenizer, tmp_path):
    data = tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, tmp_path / "tok", workers=0)
    assert {3, 17, 300} <= set(data.sample_ids.tolist()) and 4 in data.sample_ids
    mine = [300, 3, 17, 3]
    store = data.samples(mine)
    assert sorted(store) == [3, 17, 300] and len(store) == 3 and 17 in store and 4 not in store
    with pytest.raises(KeyError):
        store[4]
    blob = pickle.dumps(store)
    assert len(blob) < 1000  # (path, ids), no token
    copy = pickle.loads(blob)
    assert as_lists([copy[300], copy[3]]) == as_lists([store[300], store[3]])
    direct = {s.sample_id: s for s in load_all(files, tokenizer, max_length=64).samples}
    assert as_lists([store[300]]) == as_lists([direct[300]])


def test_skipped_records_keep_their_ids_unused_and_are_reported(tmp_path, tokenizer, conversations):
    bad = tmp_path / "bad.jsonl"
    lines = conversations.read_text().splitlines()
    bad.write_text("\n".join([lines[0], "not json", lines[1], '{"input_ids": [5, 999999]}', lines[2]]) + "\n")
    direct = load_all([bad], tokenizer, 64, on_bad_record="skip")
    data = tokenized_data([bad], tokenizer, 64, TOKENIZER_HASH, tmp_path / "tok", workers=0, on_bad_record="skip")
    assert data.sample_ids.tolist() == [s.sample_id for s in direct.samples] == [0, 2, 4]
    assert data.info.report() == direct.report() and len(data.info.bad_records) == 2
    store = data.samples([4, 0])
    assert as_lists([store[0], store[4]]) == as_lists([direct.samples[0], direct.samples[2]])
    with pytest.raises(KeyError):
        data.samples([1])  # left out: no sample of that id
    again = tokenized_data([bad], tokenizer, 64, TOKENIZER_HASH, tmp_path / "tok", workers=0, on_bad_record="skip")
    assert again.info.report() == direct.report()  # the report is kept with the data


def test_bad_record_fails_naming_it_and_leaves_nothing(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}\nnot json\n'
    )
    with pytest.raises(DFlashCacheError, match=r"bad.jsonl:2: not valid JSON"):
        tokenized_data([bad], tokenizer, 64, TOKENIZER_HASH, tmp_path / "tok", workers=0)
    assert not list((tmp_path / "tok").glob("*.arrow*"))


def test_a_kept_file_changed_since_it_was_written_is_tokenized_again_and_said_so(files, tokenizer, tmp_path):
    folder = tmp_path / "tok"
    data = tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, folder, workers=0)
    store = data.samples(data.sample_ids)
    expected = as_lists(store[i] for i in data.sample_ids.tolist())
    del store
    rewrite_ids(data.path, lambda sid, ids: (ids + 1) % len(tokenizer))  # still inside the vocabulary
    data.path.with_name(data.key + tokenized.INDEX_SUFFIX).unlink()
    notes = []
    again = tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, folder, workers=0, on_note=notes.append)
    store = again.samples(again.sample_ids)
    assert as_lists(store[i] for i in again.sample_ids.tolist()) == expected
    assert notes == [f"{data.path} is not the file that was written (its checksum differs); tokenizing the data again"]


def test_a_token_id_outside_the_vocabulary_is_named_with_its_file_and_sample(files, tokenizer, tmp_path):
    """Even where the file's checksum was made to match (ids written by other means than this tokenizer)."""
    folder = tmp_path / "tok"
    data = tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, folder, workers=0)
    victim = int(data.sample_ids[3])
    rewrite_ids(
        data.path, lambda sid, ids: np.where(np.arange(len(ids)) == 2, len(tokenizer), ids) if sid == victim else ids
    )
    info_path = data.path.with_suffix(".json")
    info = json.loads(info_path.read_text())
    info["crc32"] = zlib.crc32(data.path.read_bytes())
    info_path.write_text(json.dumps(info))
    message = (
        f"{data.path}: sample {victim}: token id {len(tokenizer)} at position 2 is outside the tokenizer's "
        f"vocabulary of {len(tokenizer)} ids; delete the file and rerun"
    )
    with pytest.raises(DFlashCacheError) as e:
        tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, folder, workers=0)
    assert str(e.value) == message


def test_temporary_files_of_killed_runs_are_removed_unless_their_lock_is_held(files, tokenizer, tmp_path):
    folder = tmp_path / "tok"
    data = tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, folder, workers=0)
    other, busy = "ab" * 16, "cd" * 16
    stale = [
        folder / f"{data.key}.arrow.tmp4194301",
        folder / f"{data.key}.index.npy.tmp17",
        folder / f"{data.key}.plan-{'ef' * 16}.npy.tmp23",
        folder / f"{other}.json.tmp29",
    ]
    kept = [folder / f"{busy}.arrow.tmp31", folder / "notes.tmp37"]
    for path in stale + kept:
        path.write_bytes(b"partial")
    hold = "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print(flush=True); time.sleep(600)"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(folder / f"{busy}.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        holder.stdout.readline()  # it holds the lock of `busy`: a run writing it
        again = tokenized_data(files, tokenizer, 64, TOKENIZER_HASH, folder, workers=0)
    finally:
        holder.kill()
        holder.wait()
    assert again.path == data.path
    assert [p.name for p in stale if p.exists()] == [] and all(p.exists() for p in kept)
