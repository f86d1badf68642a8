"""What ties a cache's other files to its manifest: the sha256 of each file in target/, and the
journals, from which a rerun of extract rebuilds the manifest. (Shards are checked by verify.py.)"""

from __future__ import annotations

from pathlib import Path

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.journal import JOURNAL_DIR
from dflash_cache.store.manifest import read_journals, spec_differences
from dflash_cache.store.paths import inside
from dflash_cache.store.shard import file_sha256


def hash_target_files(target_dir: Path) -> dict[str, str]:
    return {path.name: file_sha256(path) for path in sorted(Path(target_dir).iterdir()) if path.is_file()}


def check_target_files(target_dir: Path, manifest: dict) -> None:
    """Raises naming the first file of target/ that differs from the manifest's sha256 (a manifest
    that lists none, written before extract recorded them, has nothing to check)."""
    for name, sha256 in manifest.get("target_files", {}).items():
        path = inside(target_dir, Path(target_dir) / name)
        if not path.is_file():
            problem = "is missing"
        elif file_sha256(path) != sha256:
            problem = "does not match the manifest's sha256 (damaged or replaced)"
        else:
            continue
        raise DFlashCacheError(
            f"{path} {problem}; restore it, or delete {target_dir} and rerun the same extract command to rewrite it"
        )


def check_journals(cache) -> None:
    """The journals must say what the manifest says (a cache copied without journal/ is not checked)."""
    if cache.remote is not None:
        source, present = cache.remote, bool(cache.remote.list(JOURNAL_DIR))
    else:
        source, present = cache.root, any((cache.root / JOURNAL_DIR).glob("r*.jsonl"))
    if not present:
        return
    where = f"{cache.root}/{JOURNAL_DIR}"
    state = read_journals(source)

    def disagree(what: str) -> DFlashCacheError:
        return DFlashCacheError(
            f"{where}: {what}; a journal was damaged or manifest.json edited (a rerun of extract "
            "rebuilds the manifest from the journals: restore the right one first)"
        )

    if state.spec != cache.spec:
        fields = spec_differences(state.spec or {}, cache.spec)
        raise disagree(f"the journals hold another spec than the manifest ({'; '.join(fields)})")
    listed = {s.path: s.__dict__ for s in cache.shards}
    journaled = {s.path: s.__dict__ for s in state.shards}
    for path in sorted(set(listed) | set(journaled)):
        if path not in listed:
            raise disagree(f"{path}: in the journals but not in the manifest")
        if path not in journaled:
            raise disagree(f"{path}: in the manifest but not in the journals")
        if fields := [k for k in listed[path] if listed[path][k] != journaled[path][k]]:
            raise disagree(f"{path}: the journals and the manifest differ in {', '.join(fields)}")
    if state.skipped != cache.manifest.get("skipped", []) or (state.target_files or {}) != cache.manifest.get(
        "target_files", {}
    ):
        raise disagree("the journals and the manifest list other skipped samples or target files")
