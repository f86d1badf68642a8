"""Read training records from `--data` files.

Accepted inputs, told apart by their first bytes (not their names):
- Parquet (`PAR1`) and Arrow IPC, file (`ARROW1`) or stream form: pre-tokenized rows with an
  `input_ids` column (list of integers), an optional `loss_mask` column (list of 0/1 or bool) and an
  optional `id` column (strings or integers).
- gzip (`1f 8b`): gzip-compressed JSONL.
- Anything else is read as JSONL (a UTF-8 byte-order mark is allowed), one JSON object per line, each
  being one of `{"messages": [...]}`, ShareGPT `{"conversations": [{"from", "value"}...]}` or
  pre-tokenized `{"input_ids": [...], "loss_mask": [...]}` (loss_mask optional). Blank lines are
  skipped and are not records. The message fields read are in `dflash_cache/data/messages.py`.

Any record may carry its own `id`: a string, or an integer (kept as its decimal digits, so 42 and "42"
are the same id); absent or null is no id, any other value is a bad record. It is kept as given,
never required to be unique (merged datasets often number from 0 alike): see store/cache.py.

A pre-tokenized record without a loss mask trains on every token. Records are yielded in file order;
problems raise DFlashCacheError naming the file and the line (JSONL) or row/column (Arrow, Parquet).
With `skip_bad`, a line that is not a valid record (or is longer than `max_line_bytes`) is yielded as
a BadRecord instead, so the caller can count it and go on.
"""

from __future__ import annotations

import gzip
import json
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_cache.data.messages import parse_conversation, show
from dflash_cache.errors import DFlashCacheError, first_line

ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"
PARQUET_MAGIC = b"PAR1"
PARQUET_BATCH_ROWS = 1024  # pyarrow's default, 65,536 rows of ~2,600 tokens, is 1.4 GB held at once
GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"
READ_BLOCK = 1 << 20
MAX_ID_CHARS = 1024  # ids are listed in the manifest, so they are kept short


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]  # normalised messages (data/messages.py), as the chat template reads them
    where: str  # "file:line", for error messages
    tools: list[dict] | None = None  # the conversation's tool definitions, passed to the template
    record_id: str | None = None  # the record's own `id`, as text


@dataclass(frozen=True)
class TokenRecord:
    input_ids: np.ndarray  # [T] int64
    loss_mask: np.ndarray | None  # [T] bool, None: every token counts
    where: str  # "file:line" or "file row N"
    record_id: str | None = None  # the record's own `id`, as text


@dataclass(frozen=True)
class JsonLine:
    """A JSONL line not parsed yet (`read_records(parse_json=False)`): tokenizer processes parse it,
    so the process reading the file does not do that work for all of them."""

    text: str
    where: str


@dataclass(frozen=True)
class BadRecord:
    """A line that is not a usable record, when the caller asked to skip such lines."""

    where: str
    reason: str


Record = Conversation | TokenRecord


def check_data_file(path: str | Path) -> None:
    """A `--data` path must be a regular file: it is read more than once (hash, then records)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DFlashCacheError(f"data file {path} does not exist") from None
    except OSError as e:
        raise DFlashCacheError(f"cannot read data file {path}: {e.strerror or e}") from None
    if stat.S_ISFIFO(mode):
        raise DFlashCacheError(
            f"data file {path} is a pipe (a FIFO or <(...)), which can be read only once; the data is hashed "
            "and then read, so write it to a file first"
        )
    if stat.S_ISDIR(mode):
        raise DFlashCacheError(f"data file {path} is a directory; give the files in it")
    if not stat.S_ISREG(mode):
        raise DFlashCacheError(f"data file {path} is not a regular file")


def read_records(
    path: str | Path,
    skip_bad: bool = False,
    max_line_bytes: int | None = None,
    parse_json: bool = True,
    prompts: bool = False,
) -> Iterator[Record | BadRecord | JsonLine]:
    """Yield every record of one data file, in order; an empty file is an error. Without
    `parse_json`, a JSONL line that is not blank comes as a JsonLine (`parse_json_line` makes it a
    record or raises). With `prompts`, a conversation without an assistant turn is a record too."""
    path = Path(path)
    check_data_file(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise DFlashCacheError(f"cannot read data file {path}: {e.strerror or e}") from None
    if not head:
        raise DFlashCacheError(f"data file {path} is empty")
    if head.startswith(PARQUET_MAGIC):
        records = _read_parquet(path)
    elif head.startswith((ARROW_FILE_MAGIC, ARROW_STREAM_MAGIC)):
        records = _read_arrow(path)
    else:
        records = _read_jsonl(path, head.startswith(GZIP_MAGIC), skip_bad, max_line_bytes, parse_json, prompts)
    count = 0
    for record in records:
        count += 1
        yield record
    if count == 0:
        raise DFlashCacheError(f"data file {path} has no records")


# ---- JSONL ----------------------------------------------------------------------------------------


def _read_jsonl(
    path: Path,
    gzipped: bool,
    skip_bad: bool,
    max_line_bytes: int | None,
    parse_json: bool = True,
    prompts: bool = False,
) -> Iterator[Record | BadRecord | JsonLine]:
    with gzip.open(path, "rb") if gzipped else open(path, "rb") as f:
        try:
            for lineno, raw in _lines(f, max_line_bytes):
                where = f"{path}:{lineno}"
                try:
                    line = _line_text(raw, lineno, where, max_line_bytes)
                    record = None if line is None else JsonLine(line, where)
                    if record is not None and parse_json:
                        record = parse_json_line(record, prompts)
                except DFlashCacheError as e:
                    if not skip_bad:
                        raise
                    record = BadRecord(where, str(e)[len(where) + 2 :])
                if record is not None:
                    yield record
        except (gzip.BadGzipFile, EOFError, OSError) as e:
            raise DFlashCacheError(f"{path}: unreadable gzip data ({first_line(e)})") from None


def _lines(f: BinaryIO, max_line_bytes: int | None) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) per line; None for a line longer than `max_line_bytes`, which is read
    through in blocks and never held whole, so one huge line costs no more memory than the limit."""
    limit = -1 if max_line_bytes is None else max_line_bytes + 1
    lineno = 0
    while True:
        raw = f.readline(limit)
        if not raw:
            return
        lineno += 1
        if raw.endswith(b"\n") or max_line_bytes is None or len(raw) <= max_line_bytes:
            yield lineno, raw
            continue
        while not raw.endswith(b"\n"):
            raw = f.readline(READ_BLOCK)
            if not raw:
                break
        yield lineno, None


def _line_text(raw: bytes | None, lineno: int, where: str, max_line_bytes: int | None) -> str | None:
    """The line as text; None for a blank line (not a record)."""
    if raw is None:
        raise DFlashCacheError(
            f"{where}: the line is longer than {max_line_bytes:,} bytes, the limit for this --max-length "
            "(raise it with --max-record-bytes, or split the record)"
        )
    if lineno == 1 and raw.startswith(UTF8_BOM):
        raw = raw[len(UTF8_BOM) :]
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DFlashCacheError(f"{where}: not valid UTF-8 text") from None
    return line if line.strip() else None


def parse_json_line(line: JsonLine, prompts: bool = False) -> Record:
    """The record of a JSONL line read with `parse_json=False`."""
    try:
        obj = json.loads(line.text)
    except json.JSONDecodeError as e:
        raise DFlashCacheError(f"{line.where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DFlashCacheError(f"{line.where}: JSON nested too deeply") from None
    try:
        return _parse_object(obj, line.where, prompts)
    except DFlashCacheError as e:
        raise DFlashCacheError(f"{line.where}: {e}") from None


def _parse_object(obj: object, where: str, prompts: bool = False) -> Record:
    if not isinstance(obj, dict):
        hint = " (a JSON array file? write one object per line)" if isinstance(obj, list) else ""
        raise DFlashCacheError(f"expected a JSON object, found {type(obj).__name__}{hint}")
    forms = [key for key in ("messages", "conversations", "input_ids") if key in obj]
    if len(forms) != 1:
        found = "none" if not forms else " and ".join(forms)
        raise DFlashCacheError(
            f"a record needs exactly one of 'messages', 'conversations' or 'input_ids' (found {found})"
        )
    own_id = record_id(obj.get("id"))
    if forms[0] == "input_ids":
        ids = _int_list(obj["input_ids"], "input_ids")
        mask = obj.get("loss_mask")
        if mask is not None:
            mask = _mask_list(mask, len(ids))
        return TokenRecord(ids, mask, where, own_id)
    messages, tools = parse_conversation(obj, forms[0], prompts)
    return Conversation(messages, where, tools, own_id)


def record_id(value: object) -> str | None:
    """A record's `id` as text: a string as given, an integer as its digits; None when absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DFlashCacheError(f"'id' must be a string or an integer, found {show(value)}")
    text = value if isinstance(value, str) else str(value)
    if len(text) > MAX_ID_CHARS:
        raise DFlashCacheError(f"'id' is {len(text):,} characters long, more than the {MAX_ID_CHARS:,} allowed")
    return text


def _int_list(value: object, field: str) -> np.ndarray:
    if not isinstance(value, list) or not value:
        raise DFlashCacheError(f"'{field}' must be a non-empty list of integers")
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool):
            raise DFlashCacheError(f"'{field}' holds {show(v)}, not an integer")
    try:
        return np.array(value, dtype=np.int64)
    except OverflowError:
        big = next(v for v in value if not -(2**63) <= v < 2**63)
        raise DFlashCacheError(f"'{field}' holds {big}, an integer too large for a token id") from None


def _mask_list(value: object, length: int) -> np.ndarray:
    if not isinstance(value, list) or any(v not in (0, 1) or isinstance(v, float) for v in value):
        raise DFlashCacheError("'loss_mask' must be a list of 0/1 or true/false")
    if len(value) != length:
        raise DFlashCacheError(f"'loss_mask' has {len(value)} entries but 'input_ids' has {length}")
    return np.array(value, dtype=bool)


# ---- Parquet and Arrow ------------------------------------------------------------------------------


def _read_parquet(path: Path) -> Iterator[Record]:
    try:
        file = pq.ParquetFile(path)
        schema = file.schema_arrow
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise DFlashCacheError(f"{path}: not a readable Parquet file ({first_line(e)})") from None
    columns = _check_schema(schema, path)
    yield from _read_batches(
        validated_batches(file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns), path), path
    )


def _read_arrow(path: Path) -> Iterator[Record]:
    try:
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path)))
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            reader = pa.ipc.open_stream(pa.memory_map(str(path)))
            batches = iter(reader)
        schema = reader.schema
    except (pa.ArrowException, OSError) as e:
        raise DFlashCacheError(f"{path}: not a readable Arrow IPC file ({first_line(e)})") from None
    _check_schema(schema, path)
    yield from _read_batches(validated_batches(batches, path), path)


def validated_batches(batches: Iterator[pa.RecordBatch], path: Path, hint: str = "") -> Iterator[pa.RecordBatch]:
    """Turn Arrow errors raised part-way through a file (truncation, corruption) into user errors
    (`hint` appended). Each batch is validated first: Arrow reads lengths and offsets as the file
    declares them, and a file declaring a length of -1 aborted or crashed the process (SIGABRT,
    SIGSEGV) as it was read."""
    try:
        for batch in batches:
            batch.validate(full=True)
            yield batch
    except (pa.ArrowException, OSError) as e:
        raise DFlashCacheError(f"{path}: unreadable data part-way through the file ({first_line(e)}){hint}") from None


def _check_schema(schema: pa.Schema, path: Path) -> list[str]:
    """The columns to read; a missing or mistyped column is an error naming it."""
    try:
        names = schema.names
    except UnicodeDecodeError:
        raise DFlashCacheError(f"{path}: column names that are not UTF-8 (a damaged file?)") from None
    if "input_ids" not in names:
        raise DFlashCacheError(
            f"{path}: no 'input_ids' column (columns: {', '.join(names) or 'none'}); "
            "Parquet/Arrow input must be pre-tokenized, conversations go in JSONL"
        )
    columns = ["input_ids"] + [name for name in ("loss_mask", "id") if name in names]
    for name in columns:
        kind = schema.field(name).type
        if name == "id":
            if not _is_id(kind):
                raise DFlashCacheError(f"{path}: column 'id' must hold strings or integers, found {kind}")
            continue
        value_ok = pa.types.is_integer if name == "input_ids" else _is_int_or_bool
        if not (_is_list(kind) and value_ok(kind.value_type)):
            wanted = "integers" if name == "input_ids" else "integers or booleans"
            raise DFlashCacheError(f"{path}: column '{name}' must be a list of {wanted}, found {kind}")
    return columns


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _is_id(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _is_int_or_bool(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_boolean(kind)


def _read_batches(batches: Iterator[pa.RecordBatch], path: Path) -> Iterator[TokenRecord]:
    row = 0
    for batch in batches:
        ids = _split_lists(batch.column("input_ids"), "input_ids", path, row)
        masks = [None] * len(ids)
        if "loss_mask" in batch.schema.names:
            masks = _split_lists(batch.column("loss_mask"), "loss_mask", path, row)
        own_ids = batch.column("id").to_pylist() if "id" in batch.schema.names else [None] * len(ids)
        for i, (row_ids, row_mask, own_id) in enumerate(zip(ids, masks, own_ids)):
            where = f"{path} row {row + i}"
            if len(row_ids) == 0:
                raise DFlashCacheError(f"{where}: 'input_ids' is empty")
            if row_mask is not None:
                if len(row_mask) != len(row_ids):
                    raise DFlashCacheError(
                        f"{where}: 'loss_mask' has {len(row_mask)} entries but 'input_ids' has {len(row_ids)}"
                    )
                if row_mask.dtype != bool and not np.isin(row_mask, (0, 1)).all():
                    raise DFlashCacheError(f"{where}: 'loss_mask' holds values other than 0 and 1")
                row_mask = row_mask.astype(bool)
            if row_ids.dtype == np.uint64 and (row_ids > np.iinfo(np.int64).max).any():
                position = int((row_ids > np.iinfo(np.int64).max).argmax())
                raise DFlashCacheError(
                    f"{where}: token id {int(row_ids[position])} at position {position} is too large for a token id"
                )
            try:
                own_id = record_id(own_id)
            except DFlashCacheError as e:
                raise DFlashCacheError(f"{where}: {e}") from None
            yield TokenRecord(row_ids.astype(np.int64), row_mask, where, own_id)
        row += batch.num_rows


def _split_lists(column: pa.Array, name: str, path: Path, first_row: int) -> list[np.ndarray]:
    """One numpy array per row of a list column; nulls are errors naming the row."""
    if column.null_count:
        row = first_row + column.is_null().to_numpy(zero_copy_only=False).argmax()
        raise DFlashCacheError(f"{path} row {row}: '{name}' is null")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    values = column.flatten()
    if values.null_count:
        owner = np.searchsorted(np.cumsum(lengths), values.is_null().to_numpy(zero_copy_only=False).argmax(), "right")
        raise DFlashCacheError(f"{path} row {first_row + owner}: '{name}' holds a null value")
    return np.split(values.to_numpy(zero_copy_only=False), np.cumsum(lengths)[:-1])
