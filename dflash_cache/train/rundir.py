"""The run folder `--out`: what run it holds (`run.json`), and the checks that keep a run from
overwriting another or resuming under a different config."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_cache.errors import JSON_FILE_ERRORS, DFlashCacheError, first_line
from dflash_cache.files.folders import check_no_links_out
from dflash_cache.files.lock import LOCK_DIR, FolderLock, make_folder
from dflash_cache.store.manifest import spec_differences
from dflash_cache.train.checkpoint import latest_checkpoint

RUN_FILE = "run.json"


def run_identity(
    trajectory: dict, world: int, cache_specs: list[dict], cache_samples: list[int], drafter: dict
) -> dict:
    """What a resumed run must share with the run it continues."""
    return {
        "options": trajectory,
        "world_size": world,
        "cache_specs": cache_specs,
        "cache_samples": cache_samples,
        "drafter": drafter,
    }


def prepare_run_dir(out: Path, identity: dict, resume: bool) -> tuple[Path | None, FolderLock]:
    """Checks `out` against `resume` and takes its lock (one run at a time); a fresh run writes
    run.json. Returns the checkpoint to resume from, and the lock to hold for the whole run."""
    out = Path(out)
    run_file = out / RUN_FILE
    lock = FolderLock(out, "run", what="being trained")
    lock.check_free()  # a run training there now: not "pass --resume", which the lock would refuse
    if resume and not run_file.is_file():
        raise DFlashCacheError(f"--resume: {out} holds no run ({RUN_FILE} missing); start without --resume")
    if not resume:
        if run_file.is_file() and latest_checkpoint(out) is None:
            raise DFlashCacheError(
                f"{out} holds a training run with no checkpoint, so there is nothing to resume: "
                "delete it to start again, or choose another --out"
            )
        if run_file.is_file():
            raise DFlashCacheError(
                f"{out} already holds a training run; pass --resume to continue it or choose another --out"
            )
        if out.exists() and (not out.is_dir() or any(p.name != LOCK_DIR for p in out.iterdir())):
            raise DFlashCacheError(f"{out} exists and is not an empty folder; choose another --out")
        make_folder(out)
    check_no_links_out(out, "--out")  # a run someone handed over to resume is written into
    lock.acquire()
    try:
        checkpoint = _check_resume(out, identity) if resume else _start(out, identity)
    except BaseException:
        lock.release(discard=True)
        raise
    return checkpoint, lock


def _check_resume(out: Path, identity: dict) -> Path:
    try:
        old = json.loads((out / RUN_FILE).read_text())
    except JSON_FILE_ERRORS as e:
        raise DFlashCacheError(
            f"--resume: {out / RUN_FILE} is unreadable ({first_line(e)}); it is not a run this dflash-cache wrote"
        ) from None
    if diff := spec_differences(old, json.loads(json.dumps(identity))):
        raise DFlashCacheError(
            f"--resume: {out} was started with a different config ({'; '.join(diff[:4])}); "
            "resume with the same options and caches, or choose another --out"
        )
    checkpoint = latest_checkpoint(out)
    if checkpoint is None:
        raise DFlashCacheError(f"--resume: {out} holds no complete checkpoint yet; delete it or choose another --out")
    return checkpoint


def _start(out: Path, identity: dict) -> None:
    run_file = out / RUN_FILE
    if run_file.is_file():  # another run started here between the check above and the lock
        raise DFlashCacheError(
            f"{out} already holds a training run; pass --resume to continue it or choose another --out"
        )
    tmp = run_file.with_name(RUN_FILE + ".tmp")
    tmp.write_text(json.dumps(identity, indent=2) + "\n")
    tmp.replace(run_file)
    return None
