"""`check_holds_only`: an output folder a command writes into must be new, or hold nothing but what
that command writes there (an earlier run of it, to resume or replace); anything else would be mixed
with its files or written over. Nor may it hold a symlink that leads out of it (`check_no_links_out`)."""

from __future__ import annotations

import os
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
        raise DFlashCacheError(
            f"{option} {root} holds files that are not {what} ({shown}); choose a new or empty folder"
        )
    check_no_links_out(root, option)


def check_no_links_out(root: Path, option: str) -> None:
    """Raises if any entry under `root` is a symlink whose target lies outside it. A folder someone
    handed over (a cache to finish, a run to resume) is written into: through a link its lock file,
    journals or temporary files would overwrite or append to whatever the link names (a lock file
    linked to ~/.bashrc was overwritten with `pid P on HOST`). `root` itself may be a link."""
    if not root.is_dir():
        return
    base = root.resolve()
    folders = [str(root)]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:  # scandir's cached types: no stat per file of a 100,000-shard cache
                if entry.is_symlink():
                    if not Path(entry.path).resolve().is_relative_to(base):
                        raise DFlashCacheError(
                            f"{option} {root}: {entry.path} is a symbolic link out of the folder (to "
                            f"{Path(entry.path).resolve()}); refusing to write through it: remove the link"
                        )
                elif entry.is_dir():
                    folders.append(entry.path)
