"""`check_holds_only`: an output folder a command writes into must be new, or hold nothing but what
that command writes there (an earlier run of it, to resume or replace); anything else would be mixed
with its files or written over."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from dflash_cache.errors import DFlashCacheError


def check_holds_only(root: Path, allowed: Collection[str], option: str, what: str) -> None:
    """Raises unless `root` is absent or a folder whose entries are all in `allowed`; `what` ends
    the message "holds files that are not ...", e.g. "part of a cache"."""
    if root.exists() and not root.is_dir():
        raise DFlashCacheError(f"{option} {root} exists and is not a directory; choose a new or empty folder")
    if root.is_dir() and (foreign := sorted(p.name for p in root.iterdir() if p.name not in allowed)):
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise DFlashCacheError(f"{option} {root} holds files that are not {what} ({shown}); choose a new or empty folder")
