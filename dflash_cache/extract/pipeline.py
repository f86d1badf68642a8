"""`extract`: plan the work, hand it to one process per device, and finalise the manifest.

Batches are planned once over the whole dataset, deterministically from the data, and batch i goes
to rank i mod world. A batch is a packed row (extract/packing.py), or a padded batch of one of a few
fixed shapes for targets that cannot run packed (extract/buckets.py). A sample is therefore always
computed in the same batch, laid out the same way, whatever the number of processes: a resumed run, with the same or another process count, stores
the very same tensors as an uninterrupted one.

`--out` may be an fsspec URL (s3://bucket/prefix): shards are then written to a local staging folder
and uploaded as they are committed (store/staging.py); the remote journals decide what is done.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import AutoTokenizer

from dflash_cache.data.dataset import EncodeOptions, LoadedData
from dflash_cache.data.plan import shard_for_rank
from dflash_cache.data.plan_file import kept_plan
from dflash_cache.data.readers import check_data_file
from dflash_cache.data.tokenized import TokenizedData, tokenized_data
from dflash_cache.errors import DFlashCacheError
from dflash_cache.extract.buckets import BucketLayout
from dflash_cache.extract.packing import PackedLayout
from dflash_cache.extract.spec import make_spec, tokenizer_hash
from dflash_cache.extract.subspace_basis import prepare_basis
from dflash_cache.extract.worker import Progress, RankJob, RankSummary, run_rank
from dflash_cache.folders import check_holds_only
from dflash_cache.lock import LOCK_DIR, FolderLock, launch_key, make_folder
from dflash_cache.store.cache import TARGET_DIR
from dflash_cache.store.codecs import check_codec
from dflash_cache.store.disk_need import check_disk, disk_need
from dflash_cache.store.manifest import (
    MANIFEST,
    build_manifest,
    read_journals,
    scan_journals,
    spec_differences,
    write_manifest,
    write_remote_manifest,
)
from dflash_cache.store.remote import RemoteDir, is_remote, local_path
from dflash_cache.store.shard import JOURNAL_DIR, SHARD_DIR, TMP_SUFFIX, cut_torn_line
from dflash_cache.store.staging import Uploader, default_staging
from dflash_cache.store.subspace import SubspaceOptions, is_subspace
from dflash_cache.target.batch import Layout
from dflash_cache.target.info import TargetInfo, read_target_info
from dflash_cache.target.target import resolve_layer_ids
from dflash_cache.target.varlen import packed_support
from dflash_cache.target.warmup import start_background_warmup

HEAD = "target/head.safetensors"


# Tokens per target forward by device type. A CPU runs a 135M-parameter target at a few thousand
# tokens per second: rows of 4,096 tokens take seconds each, so progress moves row by row and the
# CPU's warm-up row (target/warmup.py) stays small.
TOKEN_BUDGETS = {"cuda": 49152, "cpu": 4096}


@dataclass
class ExtractOptions:
    target: Path
    data: list[Path]
    out: Path | str  # a folder, or an fsspec URL (s3://bucket/prefix) written through `staging`
    layers: list[int] | None = None
    num_draft_layers: int | None = None
    codec: str = "bf16-zstd"
    gpus: list[int] | None = None  # None: every visible GPU, or the CPU when there is none
    token_budget: int | None = None  # tokens per target forward; None: TOKEN_BUDGETS for the device
    max_length: int = 8192
    topk: int = 0
    on_bad_sample: str = "error"
    max_shard_bytes: int = 512 << 20
    compress_threads: int | None = None
    tokenize_workers: int | None = None  # tokenizer processes; None: one per core, 0 or 1: the main process
    tokenized_dir: Path | None = None  # where tokenized data is kept and reused (None: data.tokenized default)
    on_bad_record: str = "error"  # a record that cannot be used: stop naming file:line, or skip and list it
    chat_template_kwargs: dict | None = None  # extra chat-template options (enable_thinking...), part of the spec
    strict_template: bool = False  # a template that does not render a conversation faithfully is a bad record
    max_record_bytes: int | None = None  # longer JSONL lines are bad records; None: from max_length
    batching: str = "auto"  # packed | padded | auto (packed where the target supports it exactly)
    kernel_cache: Path | None = None  # compilers' disk caches; None: Triton's own (see target/warmup.py)
    staging: Path | None = None  # remote --out: local folder for shards until uploaded (default: under the temp dir)
    hash_weights: bool = True  # False: identify the weights by headers and samples of their bytes (target/weights.py)
    subspace: SubspaceOptions | None = None  # how a subspace codec's basis is fitted
    check_disk: bool = True  # refuse a run whose cache the output's file system cannot hold


@dataclass
class ExtractSummary:
    samples: int
    tokens: int
    bytes: int
    wall_s: float
    truncated: int
    skipped: int
    ranks: list[RankSummary] = field(default_factory=list)
    already_complete: bool = False
    bad_records: int = 0  # records left out by --on-bad-record skip (listed in the manifest)
    untrainable: int = 0  # samples left out with nothing to train on within --max-length
    manifest: dict | None = None


def _devices(gpus: list[int] | None) -> list[str]:
    visible = torch.cuda.device_count()
    if gpus is None:
        return [f"cuda:{i}" for i in range(visible)] or ["cpu"]
    if not gpus:
        raise DFlashCacheError("--gpus is empty; name at least one GPU or leave it out")
    absent = [g for g in gpus if not 0 <= g < visible]
    if absent:
        raise DFlashCacheError(f"GPU {absent[0]} is not visible (this machine shows {visible} GPU(s))")
    return [f"cuda:{g}" for g in gpus]


def _torchrun() -> tuple[int, int, int] | None:
    """(rank, world, local_rank) when started by torchrun."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return None


def _check_options(opts: ExtractOptions) -> None:
    check_codec(opts.codec)
    if opts.token_budget is not None and opts.token_budget < 1:
        raise DFlashCacheError(f"--token-budget must be positive, got {opts.token_budget}")
    if opts.max_length < 2:
        raise DFlashCacheError(f"--max-length must be at least 2, got {opts.max_length}")
    if opts.topk < 0:
        raise DFlashCacheError(f"--topk must be 0 or more, got {opts.topk}")
    if opts.batching not in ("auto", "packed", "padded"):
        raise DFlashCacheError(f"--batching must be auto, packed or padded, got {opts.batching!r}")
    if opts.on_bad_sample not in ("error", "skip"):
        raise DFlashCacheError(f"--on-bad-sample must be error or skip, got {opts.on_bad_sample!r}")
    if opts.on_bad_record not in ("error", "skip"):
        raise DFlashCacheError(f"--on-bad-record must be error or skip, got {opts.on_bad_record!r}")
    if opts.staging is not None and not is_remote(opts.out):
        raise DFlashCacheError("--staging applies only with a URL --out (s3://...); a local --out is written in place")
    seen: dict[Path, str | Path] = {}
    for path in opts.data:
        check_data_file(path)
        if (first := seen.setdefault(Path(path).resolve(), path)) is not path:
            raise DFlashCacheError(f"--data {path} is given twice (it is {first}); give each file once")


# Every name a cache folder may hold. store/manifest.py's _STARTED_CACHE differs on purpose: the
# names that show an extraction began there (locks/cache.lock, not locks/, which a run folder has too).
CACHE_ENTRIES = {MANIFEST, MANIFEST + ".tmp", TARGET_DIR, SHARD_DIR, JOURNAL_DIR, LOCK_DIR}


def _cut_torn_journal(path: Path, on_note: Callable[[str], None]) -> None:
    """A crash while a journal line was appended leaves it torn: cut it before anything is appended."""
    if path.is_file() and (cut := cut_torn_line(path)):
        on_note(
            f"{path}: cut a torn last line ({cut} bytes, left by a crash while it was written); "
            "what it recorded is extracted again"
        )


def _exists(store: Path | RemoteDir, rel: str) -> bool:
    return store.exists(rel) if isinstance(store, RemoteDir) else (store / rel).exists()


def _remove_uncommitted(root: Path, committed: set[str], ranks: list[int] | None) -> None:
    """Delete shard files no journal lists (a crash between write and journal); `ranks` None: all."""
    for path in (root / SHARD_DIR).glob("r*-*.arrow*"):
        rank = int(path.name[1:].split("-")[0])
        if ranks is not None and rank not in ranks:
            continue
        if path.name.endswith(TMP_SUFFIX) or f"{SHARD_DIR}/{path.name}" not in committed:
            path.unlink()


def choose_layout(info: TargetInfo, batching: str, token_budget: int, max_length: int, longest: int) -> Layout:
    """Packed rows of max(token budget, longest sample) tokens where the target runs them exactly;
    else padded batches on a fixed set of shapes."""
    reason = packed_support(info.config.get_text_config())
    if batching == "packed" and reason is not None:
        raise DFlashCacheError(f"--batching packed: {reason}; use --batching padded")
    if batching == "padded" or reason is not None:
        return BucketLayout(token_budget, max_length)
    return PackedLayout(max(token_budget, longest))


def extract(
    opts: ExtractOptions,
    on_progress: Callable[[Progress], None] = lambda p: None,
    on_plan: Callable[[int, int, str], None] = lambda samples, tokens, layout: None,
    on_data: Callable[[LoadedData], None] = lambda data: None,
    on_tokenize: Callable[[int, int], None] = lambda samples, tokens: None,
    on_note: Callable[[str], None] = lambda line: None,
) -> ExtractSummary:
    """Run (or resume) an extraction; returns when the cache is complete. `on_plan(samples, tokens,
    layout)` is called once with the work left to do and how the target runs it, `on_data` once with the loaded data (to report it),
    `on_tokenize(samples, tokens)` as data is tokenized (not at all when the tokenized data is kept
    from an earlier run), `on_note(line)` with what was repaired on the way."""
    started = time.perf_counter()
    _check_options(opts)
    info: TargetInfo = read_target_info(opts.target)
    layer_ids = resolve_layer_ids(info.num_layers, opts.layers, opts.num_draft_layers)
    dist = _torchrun()
    if dist is None:
        devices = _devices(opts.gpus)
        rank_ids, world = list(range(len(devices))), len(devices)
    else:
        rank, world, local = dist
        devices = [f"cuda:{local}" if torch.cuda.is_available() else "cpu"]
        rank_ids = [rank]
    budget = opts.token_budget or TOKEN_BUDGETS[torch.device(devices[0]).type]
    remote = RemoteDir(str(opts.out)) if is_remote(opts.out) else None
    root = (Path(opts.staging) if opts.staging else default_staging(remote.url)) if remote else local_path(opts.out)
    store = remote or root  # where the journals and the manifest live
    # An existing folder is resumed only if it holds nothing but a cache's own entries.
    check_holds_only(root, CACHE_ENTRIES, "--staging" if remote else "--out", "part of a cache")
    made_root = not root.exists()
    make_folder(root)
    # One lock for the cache, whatever the launch mode: the ranks of one torchrun launch share it.
    lock = FolderLock(root, "cache").acquire(None if dist is None else launch_key())
    writing = False  # until then a failed run leaves the folder as it found it
    warmup = None
    try:
        if (
            opts.batching != "padded"
            and packed_support(info.config.get_text_config()) is None
            and (dist is None or dist[2] == 0)
        ):
            # Rows are max(token budget, longest sample) long: the budget, unless a sample is longer.
            warmup = start_background_warmup(
                Path(opts.target), PackedLayout(budget), devices[0], opts.kernel_cache, info.config.get_text_config()
            )
        tokenizer = AutoTokenizer.from_pretrained(opts.target, local_files_only=True)
        encoding = EncodeOptions(
            opts.max_length, opts.chat_template_kwargs, opts.strict_template, opts.max_record_bytes
        )
        data = tokenized_data(
            opts.data,
            tokenizer,
            opts.max_length,
            tokenizer_hash(Path(opts.target)),
            opts.tokenized_dir,
            opts.tokenize_workers,
            encoding,
            opts.on_bad_record,
            on_tokenize,
            on_note,
        )
        on_data(data.info)
        if not len(data.sample_ids):
            raise DFlashCacheError(
                f"the data files hold no samples with tokens to train on ({len(data.info.bad_records)} bad records, "
                f"{len(data.info.untrainable)} with no assistant token within --max-length {opts.max_length})"
            )
        layout = choose_layout(info, opts.batching, budget, opts.max_length, int(data.lengths.max()))
        spec = make_spec(
            info,
            layer_ids,
            opts.codec,
            data.source_hash,
            opts.max_length,
            opts.topk,
            budget,
            hash_weights=opts.hash_weights,
            layout=layout,
        )
        if opts.chat_template_kwargs:
            spec["chat_template_kwargs"] = opts.chat_template_kwargs
        if is_subspace(opts.codec):
            spec["subspace"] = prepare_basis(opts.subspace, spec, root, remote, devices[0], dist is not None, on_note)
        ranks = None if dist is None else rank_ids  # whose shard files this process may delete
        state = scan_journals(store, data.rows_of, len(data.sample_ids), ranks)
        if state.spec is not None and state.spec != spec:
            diffs = "; ".join(spec_differences(state.spec, spec))
            raise DFlashCacheError(f"{store} holds a cache made with other settings ({diffs}); use another --out")
        if _exists(store, MANIFEST) and state.spec is None:
            raise DFlashCacheError(
                f"{store} has a manifest but no journals; it was not written by extract, use another --out"
            )
        if remote is None:  # a remote cache's staging folder holds a few shards at a time
            need = disk_need(root, int(data.lengths.sum()) - state.done.total(data.lengths), spec)
            if opts.check_disk:
                check_disk(need, opts.codec)
            on_note(need.describe(opts.codec))
        writing = True
        for rank in rank_ids:  # this run's own journals only: another launch's ranks may be appending to theirs
            _cut_torn_journal(root / JOURNAL_DIR / f"r{rank}.jsonl", on_note)
        if remote is not None:
            for rank in rank_ids:
                Uploader(remote, root, rank).reconcile(spec)
            state = scan_journals(remote, data.rows_of, len(data.sample_ids), ranks)
        else:
            _remove_uncommitted(root, state.committed, ranks)
        batches = kept_plan(data, layout)  # mapped from a file: each rank lists only its own share
        left = len(data.sample_ids) - state.done.count()
        on_plan(left, int(data.lengths.sum()) - state.done.total(data.lengths), layout.describe())
        threads = opts.compress_threads or max(2, (os.cpu_count() or 2) // len(devices))
        jobs = []
        complete = not left and state.target_files is not None and _exists(store, HEAD)
        if complete:
            _stop(warmup)  # nothing to compute and no target to load: only the manifest, if missing
        for rank, device in zip([] if complete else rank_ids, devices):
            mine = shard_for_rank(batches, rank, world, drop_remainder=False)
            samples = data.samples(sid for batch in mine for sid in batch)  # read when the rank needs them
            jobs.append(
                RankJob(
                    root=root,
                    target_path=Path(opts.target),
                    device=device,
                    rank=rank,
                    spec=spec,
                    layout=layout,
                    batches=mine,
                    samples=samples,
                    done=set(samples.ids[state.done.has(samples.rows)].tolist()),
                    first_shard_index=state.next_index.get(rank, 0),
                    on_bad_sample=opts.on_bad_sample,
                    max_shard_bytes=opts.max_shard_bytes,
                    compress_threads=threads,
                    # Again when a run died before journaling their hashes (a head file may be partial).
                    write_target_files=rank == 0 and (state.target_files is None or not _exists(store, HEAD)),
                    kernel_cache=opts.kernel_cache,
                    uploader=None if remote is None else Uploader(remote, root, rank),
                )
            )
        summaries = _run_jobs(jobs, on_progress)
        manifest = _finalise(store, data, data.info.report())
    except BaseException:
        _stop(warmup)
        lock.release(discard=not writing)
        if made_root and not writing and not any(root.iterdir()):
            root.rmdir()
        raise
    _stop(warmup)
    lock.release()
    return ExtractSummary(
        samples=sum(s.samples for s in summaries),
        tokens=sum(s.tokens for s in summaries),
        bytes=sum(s.bytes for s in summaries),
        wall_s=time.perf_counter() - started,
        truncated=data.info.num_truncated,
        skipped=sum(len(s.skipped) for s in summaries),
        ranks=summaries,
        bad_records=len(data.info.bad_records),
        untrainable=len(data.info.untrainable),
        already_complete=not left,
        manifest=manifest,
    )


def _stop(process) -> None:
    if process is not None and process.is_alive():
        process.kill()


def _finalise(store: Path | RemoteDir, data: TokenizedData, report: dict) -> dict | None:
    """Write the manifest once the journals cover every sample and the target head is there (under
    torchrun, the last rank to finish does it; two ranks doing it at once write the same bytes). Only
    that rank holds every shard record: the others see from a scan that the cache is not complete."""
    if scan_journals(store, data.rows_of, len(data.sample_ids)).done.count() < len(data.sample_ids) or not _exists(
        store, HEAD
    ):
        return None
    state = read_journals(store)
    manifest = build_manifest(state, {"extract": report})
    if isinstance(store, RemoteDir):
        write_remote_manifest(store, manifest)
    else:
        write_manifest(store, manifest)
    return manifest


def _run_jobs(jobs: list[RankJob], on_progress: Callable[[Progress], None]) -> list[RankSummary]:
    if len(jobs) == 1:
        return [run_rank(jobs[0], on_progress)]
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(job, events), name=f"extract-r{job.rank}", daemon=True) for job in jobs]
    for p in procs:
        p.start()
    summaries: dict[int, RankSummary] = {}
    try:
        while len(summaries) < len(jobs):
            try:
                kind, payload = events.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise DFlashCacheError(
                        f"{dead[0].name} died (exit code {dead[0].exitcode}); rerun the same command to resume"
                    ) from None
                continue
            if kind == "progress":
                on_progress(payload)
            elif kind == "done":
                summaries[payload.rank] = payload
            else:
                raise DFlashCacheError(payload)
    finally:
        for p in procs:
            if p.is_alive() and p.pid not in {None}:
                if len(summaries) < len(jobs):
                    p.kill()
            p.join(timeout=30)
    return [summaries[j.rank] for j in jobs]


def _child(job: RankJob, events) -> None:
    try:
        summary = run_rank(job, lambda p: events.put(("progress", p)))
        events.put(("done", summary))
    except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
        message = str(e) if isinstance(e, DFlashCacheError) else f"{type(e).__name__}: {e}"
        events.put(("error", f"rank {job.rank} on {job.device}: {message}"))
        if os.environ.get("DFLASH_CACHE_DEBUG"):
            traceback.print_exc()
