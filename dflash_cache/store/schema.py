"""The Arrow row schema of a shard and the per-row checksum (FORMAT.md is the written spec)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa

FORMAT_NAME = "dflash-cache"
FORMAT_VERSION = 2  # 2: the record_id column and the manifest's record_ids; 1 is read as well

ROW_SCHEMA_V1 = pa.schema(
    [
        pa.field("sample_id", pa.int64(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.bool_()), nullable=False),
        pa.field("target_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("topk_ids", pa.list_(pa.int32())),  # [T*K] row-major, null without --topk
        pa.field("topk_logprobs", pa.list_(pa.float32())),  # [T*K]
        pa.field("hidden", pa.large_binary(), nullable=False),  # compressed codec payload
        pa.field("hidden_scales", pa.binary()),  # fp32 [T, L] little-endian, fp8 and fp4 codecs only
        pa.field("checksum", pa.uint32(), nullable=False),
    ]
)
ROW_SCHEMA = ROW_SCHEMA_V1.append(pa.field("record_id", pa.string()))  # the record's own id, null: none


@dataclass
class Row:
    """One sample as it is stored: token arrays as numpy, hidden already encoded and compressed."""

    sample_id: int
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]
    target_ids: np.ndarray  # int32 [T]
    hidden: np.ndarray  # uint8 codec payload (any buffer works)
    hidden_scales: bytes | None = None
    topk_ids: np.ndarray | None = None  # int32 [T, K]
    topk_logprobs: np.ndarray | None = None  # float32 [T, K]
    record_id: str | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def checksum(self) -> int:
        return row_checksum(
            self.input_ids,
            self.loss_mask,
            self.target_ids,
            self.topk_ids,
            self.topk_logprobs,
            self.hidden,
            self.hidden_scales,
            self.record_id,
        )

    @cached_property
    def record_batch(self) -> pa.RecordBatch:
        """The row as a one-row record batch (cached: extraction builds it on a compression thread)."""
        flat = lambda a: None if a is None else [a.reshape(-1)]  # noqa: E731
        hidden = memoryview(self.hidden).cast("B")
        offsets = pa.py_buffer(np.array([0, hidden.nbytes], dtype=np.int64))
        arrays = [
            pa.array([self.sample_id], pa.int64()),
            pa.array([self.num_tokens], pa.int32()),
            pa.array([self.input_ids.astype(np.int32, copy=False)], pa.list_(pa.int32())),
            pa.array([self.loss_mask.astype(bool, copy=False)], pa.list_(pa.bool_())),
            pa.array([self.target_ids.astype(np.int32, copy=False)], pa.list_(pa.int32())),
            pa.array(flat(self.topk_ids) or [None], pa.list_(pa.int32())),
            pa.array(flat(self.topk_logprobs) or [None], pa.list_(pa.float32())),
            pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, pa.py_buffer(hidden)]),  # no copy
            pa.array([self.hidden_scales], pa.binary()),
            pa.array([self.checksum()], pa.uint32()),
            pa.array([self.record_id], pa.string()),
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=ROW_SCHEMA)


def row_checksum(
    input_ids, loss_mask, target_ids, topk_ids, topk_logprobs, hidden, hidden_scales, record_id: str | None = None
) -> int:
    """CRC-32 chained over the row's fields in schema order, as little-endian bytes (the record id as
    UTF-8); absent fields skipped, so a version-1 row (no record id) keeps its checksum."""
    crc = 0
    for part, dtype in (
        (input_ids, np.int32),
        (loss_mask, np.uint8),
        (target_ids, np.int32),
        (topk_ids, np.int32),
        (topk_logprobs, np.float32),
    ):
        if part is not None:
            crc = zlib.crc32(np.ascontiguousarray(part, dtype=dtype), crc)
    for blob in (hidden, hidden_scales, None if record_id is None else record_id.encode()):
        if blob is not None:
            crc = zlib.crc32(blob, crc)
    return crc
