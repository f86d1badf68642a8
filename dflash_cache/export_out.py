"""The folder `export --out` writes: new, empty, or an earlier export (replaced), never another folder
(a cache, a training run) into which an export's two files would be mixed or over whose files they
would be written."""

from __future__ import annotations

from pathlib import Path

from dflash_cache.errors import DFlashCacheError

EXPORT_FILES = ("config.json", "model.safetensors")


def check_export_out(out: Path) -> bool:
    """Raises unless `out` may receive an export; True when it holds an earlier one to replace."""
    out = Path(out)
    if not out.exists():
        return False
    if not out.is_dir():
        raise DFlashCacheError(f"--out {out} exists and is not a folder; choose a new or empty folder")
    names = sorted(p.name for p in out.iterdir())
    if foreign := [name for name in names if name not in EXPORT_FILES]:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise DFlashCacheError(f"--out {out} holds files that are not an export's ({shown}); "
                               "choose a new or empty folder")
    return bool(names)
