"""Load `--data` files into tokenized samples with stable ids.

A sample's id is the index of its record among all records of the given files, taken in the order
given (records of the first file are 0..n1-1, those of the second n1..n1+n2-1, and so on; blank JSONL
lines are not records). The id therefore names the same source row in every run over the same files
in the same order, whatever the number of processes.
"""

from __future__ import annotations

import hashlib
import multiprocessing
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from dflash_cache.data.readers import Conversation, Record, read_records
from dflash_cache.data.tokenize import check_token_ids, tokenize_conversation
from dflash_cache.errors import DFlashCacheError

CHUNK_RECORDS = 256  # records per task sent to a tokenizer process


@dataclass
class Sample:
    sample_id: int
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] bool


@dataclass
class LoadedData:
    samples: list[Sample]
    num_truncated: int  # samples cut to max_length
    source_hash: str  # sha256 over the bytes of the data files, in the order given

    def lengths(self) -> np.ndarray:
        return np.array([len(s.input_ids) for s in self.samples], dtype=np.int64)


def load_samples(
    paths: Sequence[str | Path], tokenizer, max_length: int, workers: int = 0
) -> LoadedData:
    """Read, tokenize and truncate every record of `paths`.

    `workers` > 1 tokenizes in that many processes; the result is identical to `workers=0`
    (records are handed out in chunks and collected in order).
    """
    if not paths:
        raise DFlashCacheError("no data files given")
    if max_length < 1:
        raise DFlashCacheError(f"max length must be at least 1, got {max_length}")
    paths = [Path(p) for p in paths]
    source_hash = hash_files(paths)
    vocab_size = len(tokenizer)
    chunks = _chunks(_all_records(paths), CHUNK_RECORDS)
    samples = []
    num_truncated = 0
    for encoded in _encode_chunks(chunks, tokenizer, vocab_size, workers):
        for input_ids, loss_mask in encoded:
            if len(input_ids) > max_length:
                input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
                num_truncated += 1
            samples.append(Sample(len(samples), input_ids, loss_mask))
    return LoadedData(samples, num_truncated, source_hash)


def hash_files(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        try:
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
        except FileNotFoundError:
            raise DFlashCacheError(f"data file not found: {path}") from None
        except OSError as e:
            raise DFlashCacheError(f"cannot read data file {path}: {e.strerror or e}") from None
    return digest.hexdigest()


def encode_record(tokenizer, vocab_size: int, record: Record) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids int32, loss_mask bool) of one record; errors name the record's file and line."""
    try:
        if isinstance(record, Conversation):
            ids, mask = tokenize_conversation(tokenizer, record.messages)
            return np.array(ids, dtype=np.int32), np.array(mask, dtype=bool)
        check_token_ids(record.input_ids, vocab_size)
        mask = record.loss_mask if record.loss_mask is not None else np.ones(len(record.input_ids), dtype=bool)
        return record.input_ids.astype(np.int32), mask
    except DFlashCacheError as e:
        raise DFlashCacheError(f"{record.where}: {e}") from None


def _all_records(paths: Sequence[Path]) -> Iterator[Record]:
    for path in paths:
        yield from read_records(path)


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def _encode_chunks(
    chunks: Iterator[list[Record]], tokenizer, vocab_size: int, workers: int
) -> Iterator[list[tuple[np.ndarray, np.ndarray]]]:
    if workers <= 1:
        for chunk in chunks:
            yield [encode_record(tokenizer, vocab_size, r) for r in chunk]
        return
    # Fork: workers start at once and inherit the tokenizer; they only tokenize, never touch CUDA.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(tokenizer, vocab_size)) as pool:
        pending: deque = deque()
        for chunk in chunks:  # at most 2 chunks in flight per worker, so memory stays bounded
            pending.append(pool.submit(_encode_in_worker, chunk))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


_worker_state: tuple | None = None


def _init_worker(tokenizer, vocab_size: int) -> None:
    global _worker_state
    _worker_state = (tokenizer, vocab_size)


def _encode_in_worker(chunk: list[Record]) -> list[tuple[np.ndarray, np.ndarray]]:
    tokenizer, vocab_size = _worker_state
    return [encode_record(tokenizer, vocab_size, r) for r in chunk]
