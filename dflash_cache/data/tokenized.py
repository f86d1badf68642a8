"""The tokenized-data cache: `--data` tokenized once, kept, and reused by resumes and later runs.

Tokenizing a million conversations takes hours of one core, so it is done once per (data files,
tokenizer files, max_length, tokenization code) and kept in `--tokenized-dir` as an Arrow IPC file
(`sample_id` int64, `input_ids` list<int32>, `loss_mask` list<bool>, `id` string: the record's own
`id`, null where it has none; a record batch per chunk of records tokenized, the kept samples in
sample id order), which `extract --data` also reads. A JSON file beside it, written last, says it
is complete and holds the data's report (records left out, and why) and the Arrow file's CRC-32,
checked with the token ids' range before each reuse. Building it streams: records are tokenized in
a process pool (one process per core by default) and written chunk by chunk, so memory holds a few
chunks and the lengths, not the data. Temporary files of killed runs are removed by the next run
that takes their lock.

Beside them, `KEY.index.npy` (int64 [6, N], `INDEX_ROWS`: each sample's id and length, and where
its tokens, loss mask and record id lie in the Arrow file), made from the Arrow file on its first
opening: every rank maps it, so the ids and lengths the plan needs are page cache shared by the
ranks of a node, not each rank's memory. A rank's own samples are read when it asks for them:
`TokenizedData.samples(ids)` is a mapping that reads a sample from the memory-mapped files when it
is looked up, holding nothing per record batch, and pickles as (path, ids), so a spawned rank
receives no sample at all.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash_cache.data import dataset, messages, readers, tokenize
from dflash_cache.data.dataset import EncodeOptions, LoadedData, Sample, checked_inputs, hash_files, stream_samples
from dflash_cache.data.rowbits import CHUNK
from dflash_cache.errors import DFlashCacheError
from dflash_cache.files import faults
from dflash_cache.files.write_errors import write_failed

FORMAT = 3  # 2: the id column, 3: its checksum; a file of another format is never reused (its key differs)
SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.int64(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.bool_()), nullable=False),
        pa.field("id", pa.string()),
    ]
)  # read back as --data, it keeps the ids
FILE_HASHES = "file-hashes.json"
INDEX_SUFFIX = ".index.npy"
RERUN = "rerun, or keep the tokenized data elsewhere with --tokenized-dir DIR"  # after a failed write
# A file being written (NAME.tmpPID), named by the lock it is written under: KEY.lock for the data's
# files, KEY.plan-PLAN.lock for a plan (plan_file.py).
TEMPORARY = re.compile(r"(?P<lock>[0-9a-f]{32}(?:\.plan-[0-9a-f]{32})?)\.(?:arrow|json|index\.npy|npy)\.tmp[0-9]+")
# The index's rows: byte offsets in the Arrow file of a sample's first token id and of its record
# id's UTF-8 bytes (-1: no id), the bit offset of its first loss-mask bit, the record id's bytes.
INDEX_ROWS = ("sample_id", "length", "ids_at", "mask_bit", "record_id_at", "record_id_bytes")


def default_tokenized_dir() -> Path:
    """$DFLASH_CACHE_TOKENIZED_DIR, else dflash-cache/tokenized in the user's cache folder."""
    if folder := os.environ.get("DFLASH_CACHE_TOKENIZED_DIR"):
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-cache" / "tokenized"


def _code_hash() -> str:
    """The code that turns records into tokens: a change to it (a chat-template fix) must not be
    served ids tokenized by the old code."""
    sha = hashlib.sha256()
    for module in (readers, messages, tokenize, dataset):
        sha.update(Path(module.__file__).read_bytes())
    return sha.hexdigest()


@dataclass
class TokenizedData:
    path: Path  # the Arrow IPC file, KEY.arrow
    sample_ids: np.ndarray  # int64 [N], increasing: the samples kept (a record left out keeps its id unused); mapped
    lengths: np.ndarray  # int64 [N]: tokens of each (after truncation); mapped
    index: np.ndarray  # int64 [len(INDEX_ROWS), N], mapped: sample_ids and lengths are its first two rows
    info: LoadedData  # the data's hash and report; its samples are in the file, not here

    @property
    def source_hash(self) -> str:
        return self.info.source_hash

    @property
    def key(self) -> str:
        """What names this data's files in the tokenized-data folder (and the plans kept beside it)."""
        return self.path.stem

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The row of each of `ids` (sample ids) in `sample_ids`, -1 where the data does not hold it."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = np.searchsorted(self.sample_ids, ids)
        inside = rows < len(self.sample_ids)
        inside[inside] = self.sample_ids[rows[inside]] == ids[inside]
        return np.where(inside, rows, -1)

    def samples(self, ids: Iterable[int]) -> SampleStore:
        """A mapping of the samples `ids` (all kept), each read from the file when looked up."""
        ids = np.unique(np.fromiter(ids, dtype=np.int64))
        rows = self.rows_of(ids)
        if len(ids) and rows.min() < 0:
            raise KeyError("a sample id that the tokenized data does not hold")
        return SampleStore(self.path, ids, rows)


class SampleStore(Mapping[int, Sample]):
    """Samples of a tokenized file, read when looked up from the mapped Arrow file at the places its
    index gives (safe from several threads: nothing is written after the maps are made)."""

    def __init__(self, path: Path, ids: np.ndarray, rows: np.ndarray):
        self.path = Path(path)
        self.ids, self.rows = ids, rows
        self._maps: tuple[np.ndarray, np.ndarray] | None = None  # (the Arrow file's bytes, the index)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"path": self.path, "ids": self.ids, "rows": self.rows}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._maps, self._lock = None, threading.Lock()

    def _mapped(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if self._maps is None:
                index = np.load(self.path.with_name(self.path.stem + INDEX_SUFFIX), mmap_mode="r", allow_pickle=False)
                self._maps = (np.asarray(np.memmap(self.path, dtype=np.uint8, mode="r")), index)
            return self._maps

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids.tolist())

    def __contains__(self, sample_id: object) -> bool:
        i = np.searchsorted(self.ids, sample_id)
        return bool(i < len(self.ids) and self.ids[i] == sample_id)

    def __getitem__(self, sample_id: int) -> Sample:
        i = np.searchsorted(self.ids, sample_id)
        if not (i < len(self.ids) and self.ids[i] == sample_id):
            raise KeyError(sample_id)
        data, index = self._mapped()
        _, n, ids_at, mask_bit, rid_at, rid_bytes = index[:, int(self.rows[i])].tolist()
        if max(ids_at + 4 * n, (mask_bit + n + 7) >> 3, rid_at + rid_bytes) > len(data):
            raise DFlashCacheError(f"{self.path} is shorter than its index says; delete it and rerun")
        input_ids = data[ids_at : ids_at + 4 * n].view(np.int32)  # a view of the mapped file
        skip = mask_bit & 7
        loss_mask = np.unpackbits(data[mask_bit >> 3 : (mask_bit + n + 7) >> 3], bitorder="little")[
            skip : skip + n
        ].astype(bool)
        record_id = None if rid_at < 0 else data[rid_at : rid_at + rid_bytes].tobytes().decode("utf-8", "replace")
        return Sample(int(sample_id), input_ids, loss_mask, record_id)


def tokenized_data(
    paths: Sequence[str | Path],
    tokenizer,
    max_length: int,
    tokenizer_hash: str,
    folder: Path | None = None,
    workers: int | None = None,
    options: EncodeOptions | None = None,
    on_bad_record: str = "error",
    on_progress: Callable[[int, int], None] = lambda samples, tokens: None,
    on_note: Callable[[str], None] = lambda line: None,
) -> TokenizedData:
    """The tokenized data of `paths` (the samples `stream_samples` keeps), built on first use
    (`on_progress(samples, tokens)` as it goes), and again when the kept file is not what was
    written (`on_note` says so); `workers`: tokenizer processes (None: one per core; 0 or 1: this
    process). Processes asking for the same data at once (torchrun ranks) build it once: the others
    wait for it."""
    paths, options = checked_inputs(paths, max_length, options, on_bad_record)
    folder = Path(folder) if folder is not None else default_tokenized_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashCacheError(
            f"cannot create the tokenized-data folder {folder} ({e.strerror}); pass --tokenized-dir DIR"
        ) from None
    source_hash = _source_hash(paths, folder)
    fields = {
        "format": FORMAT,
        "source_hash": source_hash,
        "tokenizer_hash": tokenizer_hash,
        "options": asdict(options),
        "on_bad_record": on_bad_record,
        "code_hash": _code_hash(),
    }
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
    with open(folder / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        _remove_temporaries(folder, key)
        data = _open(folder, key, fields, len(tokenizer), on_note)
        if data is None:
            _build(
                folder,
                key,
                fields,
                paths,
                tokenizer,
                options,
                on_bad_record,
                (os.cpu_count() or 1) if workers is None else workers,
                on_progress,
            )
            data = _open(folder, key, fields, len(tokenizer), on_note)
    if data is None:
        raise DFlashCacheError(f"{folder / key}.arrow was written but does not read back; delete it and rerun")
    return data


def _remove_temporaries(folder: Path, held: str) -> None:
    """Removes the temporary files of killed runs: those written under the lock `held` (which this
    process holds, so their writer is gone) and those under any other lock of `folder` that nobody
    holds (taken while they are removed). Decided by the lock, not by the writer's pid, which may
    be a process of another machine sharing the folder."""
    for lock_name, paths in _temporaries(folder).items():
        if lock_name == held:
            for path in paths:
                path.unlink(missing_ok=True)
            continue
        try:
            with open(folder / f"{lock_name}.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                for path in paths:
                    path.unlink(missing_ok=True)
        except OSError:
            pass  # held: its writer is at work (BlockingIOError), or the folder is not ours to clean


def _temporaries(folder: Path) -> dict[str, list[Path]]:
    """The temporary files in `folder`, by the lock they are written under."""
    found: dict[str, list[Path]] = {}
    for path in folder.glob("*.tmp*"):
        if match := TEMPORARY.fullmatch(path.name):
            found.setdefault(match["lock"], []).append(path)
    return found


def _open(
    folder: Path, key: str, fields: dict, vocab_size: int, on_note: Callable[[str], None]
) -> TokenizedData | None:
    """The complete tokenized file of `key`, or None (absent, unfinished, or not what its JSON says:
    a file whose checksum differs is named by `on_note`). Token ids outside the vocabulary of
    `vocab_size` ids are an error naming the sample."""
    path, info_path = folder / f"{key}.arrow", folder / f"{key}.json"
    try:
        info = json.loads(info_path.read_text())
        if not isinstance(info, dict) or any(info.get(k) != v for k, v in fields.items()):
            return None
        report = {f.name: info["report"][f.name] for f in dataclass_fields(LoadedData) if f.name != "samples"}
        if info["crc32"] != _checksum(path):
            on_note(f"{path} is not the file that was written (its checksum differs); tokenizing the data again")
            return None
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        if not reader.schema.equals(SCHEMA):
            return None
        rows = 0
        for batch in _batches(reader, path):
            _check_ids(batch, vocab_size, path)
            rows += batch.num_rows
        if type(info["rows"]) is not int or rows != info["rows"]:
            return None
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException):
        return None
    index = _index(folder / f"{key}{INDEX_SUFFIX}", path, info["rows"])
    if index is None:
        return None
    return TokenizedData(path, index[0], index[1], index, LoadedData([], **report))


def _checksum(path: Path) -> int:
    """CRC-32 of the file's bytes, as the shards' rows have (store/schema.py)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def _check_ids(batch: pa.RecordBatch, vocab_size: int, path: Path) -> None:
    ids = batch.column(1)
    values = ids.flatten().to_numpy()
    if len(values) and (values.min() < 0 or values.max() >= vocab_size):
        for row in range(batch.num_rows):
            try:
                tokenize.check_token_ids(ids[row].values.to_numpy(), vocab_size)
            except DFlashCacheError as e:
                raise DFlashCacheError(
                    f"{path}: sample {batch.column(0)[row].as_py()}: {e}; delete the file and rerun"
                ) from None


def _index(path: Path, arrow: Path, rows: int) -> np.ndarray | None:
    """The index of the Arrow file `arrow` (INDEX_ROWS), mapped from `path`; written first if absent
    or not what it should be. None if the Arrow file does not read or its ids do not increase."""
    index = _load_index(path, rows, arrow.stat().st_size)
    if index is None:
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            with pa.memory_map(str(arrow)) as source:
                base = source.read_buffer(source.size()).address  # buffers read from the map lie at base + file offset
                source.seek(0)
                reader = pa.ipc.open_file(source)
                out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int64, shape=(len(INDEX_ROWS), rows))
                at = 0
                for batch in _batches(reader, arrow):
                    out[:, at : at + batch.num_rows] = _batch_index(batch, base)
                    at += batch.num_rows
            out.flush()
            del out
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except (ValueError, pa.ArrowException):
            return None  # the Arrow file does not read as its metadata says: built again
        except OSError as e:
            raise write_failed(path, path.parent, e, RERUN) from None
        finally:
            tmp.unlink(missing_ok=True)
        index = _load_index(path, rows, arrow.stat().st_size)
    return index


def _batches(reader: pa.RecordBatchFileReader, path: Path) -> Iterator[pa.RecordBatch]:
    """The file's record batches, each validated before its columns are read: a file whose lengths lie
    (a batch of 2^20 rows over buffers of 2) crashed the reader (SIGBUS) or was silently made again."""
    batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    return readers.validated_batches(batches, path, "; delete it and rerun to tokenize the data again")


def _batch_index(batch: pa.RecordBatch, base: int) -> np.ndarray:
    """INDEX_ROWS of a record batch's samples; `base`: the address of the file's first byte. (In
    int64 throughout: Arrow's offsets are int32, places in a file of terabytes are not.)"""
    ids, mask, record_ids = batch.column(1), batch.column(2), batch.column(3)
    offsets = ids.offsets.to_numpy().astype(np.int64)
    values = ids.values  # the list offsets index it from its own offset on
    ids_at = values.buffers()[1].address - base + 4 * (values.offset + offsets[:-1])
    mask_values = mask.values
    mask_bit = (
        8 * (mask_values.buffers()[1].address - base)
        + mask_values.offset
        + mask.offsets.to_numpy().astype(np.int64)[:-1]
    )
    _, rid_offsets, rid_data = record_ids.buffers()
    rid = np.frombuffer(rid_offsets, dtype=np.int32)[
        record_ids.offset : record_ids.offset + len(record_ids) + 1
    ].astype(np.int64)
    null = record_ids.is_null().to_numpy(zero_copy_only=False)
    rid_at = np.where(null, -1, (rid_data.address - base if rid_data is not None else 0) + rid[:-1])
    return np.stack(
        [batch.column(0).to_numpy(), np.diff(offsets), ids_at, mask_bit, rid_at, np.where(null, 0, np.diff(rid))]
    )


def _load_index(path: Path, rows: int, file_bytes: int) -> np.ndarray | None:
    """The index at `path` mapped read-only, if it has the shape and type it should, its ids
    increase and every place it gives lies inside an Arrow file of `file_bytes` bytes (checked a
    chunk at a time); None otherwise. Never unpickled."""
    try:
        index = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if index.dtype != np.dtype("<i8") or index.shape != (len(INDEX_ROWS), rows):
        return None
    for start in range(0, rows, CHUNK):
        ids = index[0, max(0, start - 1) : start + CHUNK]  # overlapping by one: every step checked
        _, n, ids_at, mask_bit, rid_at, rid_bytes = np.asarray(index[:, start : start + CHUNK])
        if (
            np.any(np.diff(ids) <= 0)
            or n.min() < 1
            or ids_at.min() < 0
            or np.any(ids_at % 4)
            or (ids_at + 4 * n).max() > file_bytes
            or mask_bit.min() < 0
            or (mask_bit + n).max() > 8 * file_bytes
            or rid_bytes.min() < 0
            or rid_at.min() < -1
            or (rid_at + rid_bytes).max() > file_bytes
        ):
            return None
    return index


def _build(
    folder: Path,
    key: str,
    fields: dict,
    paths: list[Path],
    tokenizer,
    options: EncodeOptions,
    on_bad_record: str,
    workers: int,
    on_progress: Callable[[int, int], None],
) -> None:
    path = folder / f"{key}.arrow"
    tmp = path.with_suffix(f".arrow.tmp{os.getpid()}")
    report = LoadedData([], 0, fields["source_hash"])
    for stale in [folder / f"{key}{INDEX_SUFFIX}", *folder.glob(f"{key}.plan-*.npy")]:  # of a file built before
        stale.unlink(missing_ok=True)
    rows = 0
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
            for kept in stream_samples(report, paths, tokenizer, options, workers, on_bad_record):
                if kept:
                    writer.write_batch(_record_batch(kept))
                rows += len(kept)
                on_progress(len(kept), sum(len(s.input_ids) for s in kept))
                faults.point("tokenize.chunk")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        crc32 = _checksum(tmp)
        os.replace(tmp, path)
        info = {
            **fields,
            "rows": rows,
            "crc32": crc32,
            "report": {k: v for k, v in asdict(report).items() if k != "samples"},
        }
        info_tmp = folder / f"{key}.json.tmp{os.getpid()}"
        info_tmp.write_text(json.dumps(info, sort_keys=True) + "\n")
        os.replace(info_tmp, folder / f"{key}.json")
    except OSError as e:
        raise write_failed("the tokenized data", folder, e, RERUN) from None
    finally:
        tmp.unlink(missing_ok=True)
        pa.default_memory_pool().release_unused()  # the pool keeps its peak resident otherwise


def _record_batch(samples: list[Sample]) -> pa.RecordBatch:
    offsets = pa.array(np.concatenate([[0], np.cumsum([len(s.input_ids) for s in samples])]).astype(np.int32))
    values = pa.array(np.concatenate([s.input_ids for s in samples]).astype(np.int32, copy=False))
    mask_values = pa.array(np.concatenate([s.loss_mask for s in samples]).astype(bool, copy=False), pa.bool_())
    return pa.RecordBatch.from_arrays(
        [
            pa.array([s.sample_id for s in samples], pa.int64()),
            pa.ListArray.from_arrays(offsets, values),
            pa.ListArray.from_arrays(offsets, mask_values),
            pa.array([s.record_id for s in samples], pa.string()),
        ],
        schema=SCHEMA,
    )


def _source_hash(paths: list[Path], folder: Path) -> str:
    """`hash_files(paths)`, remembered in `folder` by the files' (path, size, mtime, inode): a resume
    does not read terabytes of data again to hash them."""
    try:
        stats = [(str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ino) for p in paths for st in [p.stat()]]
    except FileNotFoundError as e:
        raise DFlashCacheError(f"data file not found: {e.filename}") from None
    key = hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    memo_path = folder / FILE_HASHES
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    found = memo.get(key)
    if isinstance(found, str) and len(found) == 64:
        return found
    digest = hash_files(paths)
    memo[key] = digest
    tmp = memo_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(memo))
    os.replace(tmp, memo_path)
    return digest
