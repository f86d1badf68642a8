"""Paths read from files (manifests, journals, remote listings) are checked before anything is
opened, fetched, written or deleted with them: a cache is something people download.

A shard path is `shards/NAME.arrow`; a file name (of target/, of a listing) is one plain name; and
a local file they name must not be a symlink that leads out of the cache.
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash_cache.errors import DFlashCacheError

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def is_file_name(name: object) -> bool:
    """One path component of letters, digits, `._-`, not starting with a dot (so not `.` or `..`)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_shard_path(path: object) -> str:
    """`path` itself if it is `shards/NAME.arrow`; ValueError otherwise."""
    if not (
        isinstance(path, str)
        and path.startswith("shards/")
        and path.endswith(".arrow")
        and is_file_name(path[len("shards/") :])
    ):
        raise ValueError(f"shard path {path!r} is not shards/NAME.arrow")
    return path


def check_file_name(name: object, where: str) -> str:
    if not is_file_name(name):
        raise DFlashCacheError(f"{where}: {name!r} is not a plain file name; refusing to use it")
    return name


def inside(root: Path, path: Path) -> Path:
    """`path` (under `root`), after checking that no symlink on the way leads out of `root`."""
    resolved, base = Path(path).resolve(), Path(root).resolve()
    if not resolved.is_relative_to(base):
        raise DFlashCacheError(f"{path} leads out of the cache (to {resolved}); refusing to read it")
    return path
