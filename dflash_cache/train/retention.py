"""`--keep-last N`: how many complete checkpoints a run keeps (a 27B drafter's, with its optimizer
state, is about 16 GB)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dflash_cache.train.checkpoint import complete_checkpoints


def prune_checkpoints(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the `keep_last` newest complete checkpoints (0: keep every one). Returns the deleted.

    Called after a checkpoint is complete, so the newest one, which resume takes, is never deleted. Each
    goes by a rename to the temporary name of an unfinished checkpoint first, so a crash part-way leaves
    nothing that looks complete (the next run deletes such folders)."""
    if keep_last < 1:
        return []
    old = [path for _, path in complete_checkpoints(run_dir)[:-keep_last]]
    for path in old:
        doomed = path.with_name(f".{path.name}.tmp")
        os.replace(path, doomed)
        shutil.rmtree(doomed)
    return old
