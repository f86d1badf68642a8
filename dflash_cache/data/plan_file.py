"""An extraction plan made once per tokenized data and layout, and kept beside the tokenized data.

Making a plan sorts every sample (tens of bytes a sample for a moment) and holds 8 bytes a sample
after; made by every rank, it was each rank's memory of the whole dataset. The first process that
needs it makes it (under a file lock: one per node under torchrun) and writes
`KEY.plan-PLAN.npy` beside the tokenized data `KEY.arrow`; every process maps it read-only and
lists only its own batches, so the plan is page cache that the ranks of a node share.

PLAN hashes what determines the plan besides the data: the layout (its type and fields) and the
code that plans (data/plan.py and the layout's module). The file is one int64 array: the number of
batches B, the B + 1 batch starts, then the N sample ids in plan order. It is checked when read
(type, shape, starts, and that the batches hold every sample of the tokenized data once), a chunk
at a time, and never unpickled; one that fails the check is made again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Protocol

import numpy as np

from dflash_cache.data import plan as plan_module
from dflash_cache.data.plan import Batches
from dflash_cache.data.rowbits import CHUNK, RowBits
from dflash_cache.data.tokenized import RERUN, TokenizedData
from dflash_cache.errors import DFlashCacheError
from dflash_cache.files.write_errors import write_failed

FORMAT = 1


class Planner(Protocol):
    def plan(self, sample_ids: np.ndarray, lengths: np.ndarray) -> Batches: ...


def kept_plan(data: TokenizedData, layout: Planner) -> Batches:
    """`layout.plan(data.sample_ids, data.lengths)`, read from the file beside the data if an
    earlier process made it, else made and written there."""
    path = data.path.with_name(f"{data.key}.plan-{plan_key(layout)}.npy")
    plan = _load(path, data)  # written whole under its name (a rename): no lock needed to read it
    if plan is None:
        try:
            with open(path.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
                plan = _load(path, data)
                if plan is None:
                    _write(path, layout.plan(data.sample_ids, data.lengths))
                    plan = _load(path, data)
        except OSError as e:
            raise write_failed("the plan", path.parent, e, RERUN) from None
    if plan is None:
        raise DFlashCacheError(f"{path} was written but does not read back; delete it and rerun")
    return plan


def plan_key(layout: Planner) -> str:
    code = hashlib.sha256()
    for module in (plan_module, sys.modules[type(layout).__module__]):
        code.update(Path(module.__file__).read_bytes())
    fields = {
        "format": FORMAT,
        "layout": f"{type(layout).__module__}.{type(layout).__qualname__}",
        "fields": repr(layout),
        "code": code.hexdigest(),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def _write(path: Path, plan: Batches) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    batches = len(plan)
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int64, shape=(2 + batches + len(plan.ids),))
        out[0] = batches
        out[1 : batches + 2] = plan.starts
        out[batches + 2 :] = plan.ids
        out.flush()
        del out
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path, data: TokenizedData) -> Batches | None:
    """The plan at `path`, mapped, if it is a plan of `data`'s samples; None if absent or not."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    n = len(data.sample_ids)
    if array.dtype != np.dtype("<i8") or array.ndim != 1 or len(array) < 2:
        return None
    batches = int(array[0])
    if not 0 <= batches <= n or len(array) != 2 + batches + n:
        return None
    starts, ids = array[1 : batches + 2], array[batches + 2 :]
    if starts[0] != 0 or starts[-1] != n:
        return None
    for at in range(0, batches, CHUNK):
        if np.any(np.diff(starts[at : at + CHUNK + 1]) <= 0):  # overlapping by one: every step checked
            return None
    seen = RowBits(n)
    for at in range(0, n, CHUNK):
        rows = data.rows_of(ids[at : at + CHUNK])
        if rows.min() < 0 or not seen.add(rows).all():
            return None
    return Batches(ids, starts)
