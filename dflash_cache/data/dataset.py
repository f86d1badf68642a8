"""Stream `--data` files as tokenized samples with stable ids.

A sample's id is the index of its record among all records of the given files, taken in the order
given (records of the first file are 0..n1-1, those of the second n1..n1+n2-1, and so on; blank JSONL
lines are not records). The id therefore names the same source row in every run over the same files
in the same order, whatever the number of processes. A skipped record keeps its id unused. A
record's own `id` field (readers.py) travels with its sample as `record_id`, for lookup.

Records that cannot be used (malformed lines, lines over the size limit, template errors, token ids
outside the vocabulary) stop the load naming `file:line`, or with `on_bad_record="skip"` are left
out and listed. Samples with nothing to train on once cut to `max_length` (an all-zero loss mask)
are always left out and listed.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import chain, islice
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from dflash_cache.data.readers import (
    BadRecord,
    Conversation,
    JsonLine,
    Record,
    check_data_file,
    parse_json_line,
    read_records,
)
from dflash_cache.data.tokenize import KINDS, check_token_ids, encode_conversation
from dflash_cache.errors import DFlashCacheError

CHUNK_RECORDS = 256  # records per task sent to a tokenizer process
BYTES_PER_TOKEN_LIMIT = 256  # a JSONL line may hold this many bytes per --max-length token ...
MIN_RECORD_BYTES = 4 << 20  # ... and at least this many
UNFAITHFUL_EXAMPLES = 5


@dataclass
class Sample:
    sample_id: int
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] bool
    record_id: str | None = None  # the record's own `id`, as text


@dataclass(frozen=True)
class EncodeOptions:
    """How records become samples (what changes the stored tokens, and what is refused)."""

    max_length: int
    template_kwargs: dict | None = None  # extra chat-template options (enable_thinking...)
    strict_template: bool = False  # a template that does not render the data faithfully is an error
    max_record_bytes: int | None = None  # longer JSONL lines are refused unread; None: from max_length

    def record_bytes(self) -> int:
        return self.max_record_bytes or max(MIN_RECORD_BYTES, BYTES_PER_TOKEN_LIMIT * self.max_length)


@dataclass
class EncodedRecord:
    """One record as a sample: ids and mask cut to max_length, and what was found on the way."""

    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] bool
    truncated: bool
    masked: np.ndarray  # [len(KINDS)] masked tokens of each kind (pre-tokenized masks count as content)
    unfaithful: list[str]
    record_id: str | None = None


@dataclass
class LoadedData:
    samples: list[Sample]
    num_truncated: int  # samples cut to max_length
    source_hash: str  # sha256 over the bytes of the data files, in the order given
    bad_records: list[dict] = field(default_factory=list)  # {"where", "reason"} of records left out
    untrainable: list[dict] = field(default_factory=list)  # {"where", "sample_id"}: nothing to train on
    unfaithful: int = 0  # conversations whose rendered turns differ from what generation sees
    unfaithful_examples: list[str] = field(default_factory=list)
    masked_tokens: dict[str, int] = field(default_factory=dict)  # masked tokens of each kind

    def report(self) -> dict:
        """What the manifest records about the data, besides the samples."""
        return {
            "truncated": self.num_truncated,
            "bad_records": self.bad_records,
            "untrainable": self.untrainable,
            "unfaithful": {"count": self.unfaithful, "examples": self.unfaithful_examples},
            "masked_tokens": self.masked_tokens,
        }


def checked_inputs(
    paths: Sequence[str | Path], max_length: int, options: EncodeOptions | None, on_bad_record: str
) -> tuple[list[Path], EncodeOptions]:
    if not paths:
        raise DFlashCacheError("no data files given")
    if max_length < 1:
        raise DFlashCacheError(f"max length must be at least 1, got {max_length}")
    if on_bad_record not in ("error", "skip"):
        raise DFlashCacheError(f"--on-bad-record must be error or skip, got {on_bad_record!r}")
    return [Path(p) for p in paths], replace(options or EncodeOptions(max_length), max_length=max_length)


def stream_samples(
    data: LoadedData, paths: Sequence[Path], tokenizer, options: EncodeOptions, workers: int, on_bad_record: str
) -> Iterator[list[Sample]]:
    """The samples kept from `paths`, chunk by chunk in order; what is left out or found on the way
    (bad records, untrainable samples, truncation, unfaithful renderings, masked kinds) goes to
    `data`'s report fields as it streams (its `samples` are left alone)."""
    vocab_size = len(tokenizer)
    records = _all_records(paths, options.record_bytes())
    masked = np.zeros(len(KINDS), dtype=np.int64)
    sample_id = 0
    for chunk in _encode_chunks(_chunks(records, CHUNK_RECORDS), tokenizer, vocab_size, options, workers):
        kept = []
        for where, result in chunk:
            sid, sample_id = sample_id, sample_id + 1
            if isinstance(result, str):
                if on_bad_record == "error":
                    raise DFlashCacheError(f"{where}: {result}")
                data.bad_records.append({"where": where, "reason": result})
                continue
            if result.unfaithful:
                data.unfaithful += 1
                if len(data.unfaithful_examples) < UNFAITHFUL_EXAMPLES:
                    data.unfaithful_examples.append(f"{where}: {'; '.join(result.unfaithful)}")
            if not result.loss_mask.any():
                data.untrainable.append({"where": where, "sample_id": sid})
                continue
            data.num_truncated += result.truncated
            masked += result.masked
            kept.append(Sample(sid, result.input_ids, result.loss_mask, result.record_id))
        data.masked_tokens = dict(zip(KINDS, masked.tolist()))
        yield kept


def hash_files(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        check_data_file(path)
        try:
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
        except OSError as e:
            raise DFlashCacheError(f"cannot read data file {path}: {e.strerror or e}") from None
    return digest.hexdigest()


def encode_record(tokenizer, vocab_size: int, record: Record, options: EncodeOptions) -> EncodedRecord:
    """One record as a sample; errors are DFlashCacheError without the record's place."""
    if isinstance(record, Conversation):
        encoded = encode_conversation(tokenizer, record.messages, record.tools, options.template_kwargs)
        if encoded.dropped:
            raise DFlashCacheError(
                f"the chat template leaves out what the data has ({'; '.join(encoded.dropped)}): "
                "remove it from the record, or skip such records with --on-bad-record skip"
            )
        if encoded.unfaithful and options.strict_template:
            raise DFlashCacheError(
                f"the chat template does not render this conversation faithfully: {'; '.join(encoded.unfaithful)}"
            )
        ids, kinds, unfaithful = np.array(encoded.input_ids, dtype=np.int32), encoded.kinds, encoded.unfaithful
    else:
        check_token_ids(record.input_ids, vocab_size)
        ids, unfaithful = record.input_ids.astype(np.int32), []
        mask = record.loss_mask if record.loss_mask is not None else np.ones(len(ids), dtype=bool)
        kinds = mask.astype(np.uint8) * (1 + KINDS.index("content"))
    truncated = len(ids) > options.max_length
    ids, kinds = ids[: options.max_length], kinds[: options.max_length]
    masked = np.bincount(kinds, minlength=len(KINDS) + 1)[1:].astype(np.int64)
    return EncodedRecord(ids, kinds > 0, truncated, masked, unfaithful, record.record_id)


def _encode_or_reason(
    tokenizer, vocab_size: int, record: Record | BadRecord | JsonLine, options: EncodeOptions
) -> tuple[str, EncodedRecord | str]:
    """(where, the sample or why the record cannot be one)."""
    if isinstance(record, BadRecord):
        return record.where, record.reason
    if isinstance(record, JsonLine):
        try:
            record = parse_json_line(record)
        except DFlashCacheError as e:
            return record.where, str(e)[len(record.where) + 2 :]  # the message without its "where: "
    try:
        return record.where, encode_record(tokenizer, vocab_size, record, options)
    except DFlashCacheError as e:
        return record.where, str(e)


def _all_records(paths: Sequence[Path], max_line_bytes: int) -> Iterator[Record | BadRecord | JsonLine]:
    """JSONL lines are parsed where they are tokenized (in the pool, when there is one); a line's
    error comes as a BadRecord, so errors surface in file order whoever finds them."""
    for path in paths:
        yield from read_records(path, skip_bad=True, max_line_bytes=max_line_bytes, parse_json=False)


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def _encode_chunks(
    chunks: Iterator[list[Record | BadRecord | JsonLine]],
    tokenizer,
    vocab_size: int,
    options: EncodeOptions,
    workers: int,
) -> Iterator[list[tuple[str, EncodedRecord | str]]]:
    head = list(islice(chunks, 2))
    chunks = chain(head, chunks)
    if workers <= 1 or len(head) < 2:  # one chunk: starting a pool would cost more than it saves
        for chunk in chunks:
            yield [_encode_or_reason(tokenizer, vocab_size, r, options) for r in chunk]
        return
    context = _pool_context(tokenizer)
    reader, writer = context.Pipe(duplex=False)  # the workers' lifeline: only this process holds its writer
    with (
        reader,
        writer,
        ProcessPoolExecutor(
            workers, mp_context=context, initializer=_init_worker, initargs=(reader, tokenizer, vocab_size, options)
        ) as pool,
    ):
        pending: deque = deque()
        for chunk in chunks:  # at most 2 chunks in flight per worker, so memory stays bounded
            if any(isinstance(r, (JsonLine, Conversation)) for r in chunk):
                pending.append(pool.submit(_encode_in_worker, chunk))
            else:  # token ids read from Arrow/Parquet: checking them here costs less than a trip to a worker
                pending.append(Future())
                pending[-1].set_result([_encode_or_reason(tokenizer, vocab_size, r, options) for r in chunk])
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _pool_context(tokenizer) -> multiprocessing.context.BaseContext:
    """Workers forked from a fresh server process (spawned where there is no forkserver): a forked
    worker held this process's descriptors, among them its flocks on the cache and the tokenized
    data, and kept them, blocking every later run, after this process was killed. The server imports
    beforehand what each worker needs, this module and the tokenizer's code, so a worker costs a
    fork and the tokenizer's unpickling."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # "__main__": a script's main module. One run with -m is imported again by each worker whatever
    # the server holds (runpy warns of it if preloaded), cheaply once what it imports is preloaded.
    context.set_forkserver_preload(["__main__", __name__, type(tokenizer).__module__])
    return context


_worker_state: tuple | None = None


def _init_worker(lifeline: Connection, tokenizer, vocab_size: int, options: EncodeOptions) -> None:
    global _worker_state
    _worker_state = (tokenizer, vocab_size, options)
    threading.Thread(target=_exit_with_parent, args=(lifeline,), daemon=True).start()


def _exit_with_parent(lifeline: Connection) -> None:
    """Ends the worker once the process that owns the pool has ended (its end of the pipe closes):
    the pool's queues stay open in the workers themselves, which would otherwise wait on them for
    ever after a SIGKILL or SIGTERM of their parent."""
    try:
        lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(1)


def _encode_in_worker(chunk: list[Record | BadRecord | JsonLine]) -> list[tuple[str, EncodedRecord | str]]:
    tokenizer, vocab_size, options = _worker_state
    return [_encode_or_reason(tokenizer, vocab_size, r, options) for r in chunk]
