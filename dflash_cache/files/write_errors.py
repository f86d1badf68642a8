"""The one-line error for a write that failed: what, where, why, the free space there, and what to rerun.

A full disk (ENOSPC), a file-size limit (EFBIG) or a read-only folder raise OSError from our own
writes; safetensors raises SafetensorError, whose message carries the OS error number as text
("I/O error: No space left on device (os error 28)"). Either way the user is told the folder, how
much space is free in it, and the command that continues where the run stopped.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from dflash_cache.console.units import size
from dflash_cache.errors import DFlashCacheError, first_line
from dflash_cache.files.lock import NOT_WRITABLE

_OS_ERROR = re.compile(r"os error (\d+)|code: (\d+)")


def write_failed(what: str | Path, folder: str | Path, error: Exception, then: str) -> DFlashCacheError:
    """`writing WHAT failed: WHY; free space in FOLDER (N MB free now) ... and THEN`."""
    number = getattr(error, "errno", None)
    if number is None and (match := _OS_ERROR.search(str(error))):
        number = int(match.group(1) or match.group(2))
    reason = os.strerror(number) if number else first_line(error)
    if number in NOT_WRITABLE:
        return DFlashCacheError(f"writing {what} failed: {reason}; make it writable and {then}")
    try:
        free = f" ({size(shutil.disk_usage(folder).free)} free now)"
    except OSError:
        free = ""
    return DFlashCacheError(
        f"writing {what} failed: {reason}; free space in {folder}{free} (or raise the file-size limit) and {then}"
    )
