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

from dflash_cache.data.dataset import EncodeOptions
from dflash_cache.data.plan import shard_for_rank
from dflash_cache.data.plan_file import kept_plan
from dflash_cache.data.readers import check_data_file
from dflash_cache.data.tokenized import TokenizedData, tokenized_data
from dflash_cache.errors import DFlashCacheError
from dflash_cache.extract.buckets import BucketLayout
from dflash_cache.extract.events import ExtractEvents
from dflash_cache.extract.options import TOKEN_BUDGETS, ExtractOptions
from dflash_cache.extract.packing import PackedLayout
from dflash_cache.extract.spec import make_spec, tokenizer_hash
from dflash_cache.extract.subspace_basis import prepare_basis
from dflash_cache.extract.worker import Progress, RankJob, RankSummary, run_rank
from dflash_cache.files.lock import launch_key
from dflash_cache.store.codecs import check_codec
from dflash_cache.store.disk_need import check_disk, disk_need
from dflash_cache.store.remote import is_remote
from dflash_cache.store.resume import Resumed, WritableCache
from dflash_cache.store.subspace import SubspaceOptions, is_subspace
from dflash_cache.target.batch import Layout
from dflash_cache.target.families import Batching, check_extractable, choose_batching
from dflash_cache.target.info import TargetInfo, read_target_info
from dflash_cache.target.parallel import Group, check_fits, group_of, join_launch
from dflash_cache.target.precision import describe_forward_dtype
from dflash_cache.target.target import resolve_layer_ids
from dflash_cache.target.warmup import start_background_warmup

HEAD = "target/head.safetensors"


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
    beside_writer: bool = False  # a tensor-parallel process that computed its part while process 0 wrote


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
    if opts.tp < 1:
        raise DFlashCacheError(f"--tp must be 1 or more, got {opts.tp}")
    if opts.tp != 1 and _torchrun() is None:
        raise DFlashCacheError(
            f"--tp {opts.tp} splits the target over the processes of a torchrun launch: "
            f"start extract with torchrun --nproc-per-node {opts.tp}"
        )
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


def choose_layout(batching: Batching, token_budget: int, max_length: int, longest: int) -> Layout:
    """Packed rows of max(token budget, longest sample) tokens where they are exact for the target;
    else padded batches on a fixed set of shapes."""
    if batching.packed:
        return PackedLayout(max(token_budget, longest))
    return BucketLayout(token_budget, max_length)


def extract(opts: ExtractOptions, events: ExtractEvents | None = None) -> ExtractSummary:
    """Run (or resume) an extraction; returns when the cache is complete."""
    events = events or ExtractEvents()
    started = time.perf_counter()
    _check_options(opts)
    info: TargetInfo = read_target_info(opts.target)
    weights = check_extractable(info)
    layer_ids = resolve_layer_ids(info.num_layers, opts.layers, opts.num_draft_layers)
    batching = choose_batching(info.config.get_text_config(), opts.batching, opts.max_length)
    dist = _torchrun()
    devices, rank_ids, world, group = _launch(opts, dist)
    writes = group is None or group.writes  # the other processes of a group compute beside its writer
    if torch.device(devices[0]).type == "cuda":
        check_fits(weights, torch.cuda.get_device_properties(devices[0]).total_memory, opts.tp)
    budget = opts.token_budget or TOKEN_BUDGETS[torch.device(devices[0]).type]
    # One lock for the cache, whatever the launch mode: the ranks of one torchrun launch share it.
    cache = WritableCache.open(opts.out, opts.staging, None if dist is None else launch_key())
    warmup = None
    try:
        if dist is None or dist[2] == 0:
            warmup = _start_warmup(opts, info, batching, budget, devices[0])
        data = _tokenized(opts, events)
        layout = choose_layout(batching, budget, opts.max_length, int(data.lengths.max()))
        spec = _spec(opts, info, layer_ids, data, budget, layout)
        if is_subspace(opts.codec):
            spec["subspace"] = prepare_basis(_subspace(opts), spec, cache, devices[0], dist is not None, events.note)
        resumed = _resume(cache, spec, data, rank_ids, dist is None, group, devices[0], events)
        left = len(data.sample_ids) - resumed.done.count()
        tokens_left = int(data.lengths.sum()) - resumed.done.total(data.lengths)
        _check_disk(opts, cache, tokens_left, spec, events)
        events.plan(left, tokens_left, f"{layout.describe()}{describe_forward_dtype(devices[0])}: {batching.reason}")
        complete = not left and resumed.target_files_done
        if complete:
            _stop(warmup)  # nothing to compute and no target to load: only the manifest, if missing
        ranks = [] if complete else list(zip(rank_ids, devices))
        jobs = _rank_jobs(opts, cache, spec, layout, data, resumed, ranks, world, group)
        summaries = _run_jobs(jobs, events.progress)
        manifest = cache.finalise(data.rows_of, len(data.sample_ids), data.info.report()) if writes else None
    except BaseException:
        _stop(warmup)
        cache.close(failed=True)
        raise
    _stop(warmup)
    cache.close()
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
        beside_writer=not writes,
    )


def _launch(opts: ExtractOptions, dist: tuple[int, int, int] | None) -> tuple[list[str], list[int], int, Group | None]:
    """This process's devices, the rank ids it runs, the number of ranks, and its tensor-parallel group."""
    if dist is None:
        devices = _devices(opts.gpus)
        return devices, list(range(len(devices))), len(devices), None
    rank, world, local = dist
    devices = [f"cuda:{local}" if torch.cuda.is_available() else "cpu"]
    if opts.tp <= 1:
        return devices, [rank], world, None
    return devices, [0], 1, group_of(rank, world, opts.tp)  # a group is one rank


def _check_disk(
    opts: ExtractOptions, cache: WritableCache, tokens_left: int, spec: dict, events: ExtractEvents
) -> None:
    if cache.remote is not None:  # a remote cache's staging folder holds a few shards at a time
        return
    need = disk_need(cache.root, tokens_left, spec)
    if opts.check_disk:
        check_disk(need, opts.codec)
    events.note(need.describe(opts.codec))


def _start_warmup(opts: ExtractOptions, info: TargetInfo, batching: Batching, budget: int, device: str):
    """Compile the packed kernels in the background while the data is tokenized (packed rows only)."""
    if not batching.packed:
        return None
    # Rows are max(token budget, longest sample) long: the budget, unless a sample is longer.
    return start_background_warmup(
        Path(opts.target), PackedLayout(budget), device, opts.kernel_cache, info.config.get_text_config()
    )


def _tokenized(opts: ExtractOptions, events: ExtractEvents) -> TokenizedData:
    tokenizer = AutoTokenizer.from_pretrained(opts.target, local_files_only=True)
    encoding = EncodeOptions(opts.max_length, opts.chat_template_kwargs, opts.strict_template, opts.max_record_bytes)
    data = tokenized_data(
        opts.data,
        tokenizer,
        opts.max_length,
        tokenizer_hash(Path(opts.target)),
        opts.tokenized_dir,
        opts.tokenize_workers,
        encoding,
        opts.on_bad_record,
        events.tokenize,
        events.note,
    )
    events.data(data.info)
    if not len(data.sample_ids):
        raise DFlashCacheError(
            f"the data files hold no samples with tokens to train on ({len(data.info.bad_records)} bad records, "
            f"{len(data.info.untrainable)} with no assistant token within --max-length {opts.max_length})"
        )
    return data


def _subspace(opts: ExtractOptions) -> SubspaceOptions | None:
    if opts.subspace_sample is None:
        return None
    return SubspaceOptions(opts.subspace_sample, opts.subspace_rank, opts.subspace_energy, opts.subspace_sample_tokens)


def _spec(
    opts: ExtractOptions, info: TargetInfo, layer_ids: list[int], data: TokenizedData, budget: int, layout: Layout
) -> dict:
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
    if opts.tp > 1:  # a split target sums its matmuls in another order: other bf16 roundings
        spec["tensor_parallel"] = opts.tp
    return spec


def _resume(
    cache: WritableCache,
    spec: dict,
    data: TokenizedData,
    rank_ids: list[int],
    every_rank: bool,
    group: Group | None,
    device: str,
    events: ExtractEvents,
) -> Resumed:
    """What is done; the process that writes repairs what a crash left first. A tensor-parallel
    group's processes must run the same batches: the others read what is done once it has."""
    args = (spec, data.rows_of, len(data.sample_ids), rank_ids, every_rank, events.note)
    resumed = cache.resume(*args) if group is None or group.writes else None
    if group is not None:
        join_launch(device)
    return resumed or cache.resume(*args, repair=False)


def _rank_jobs(
    opts: ExtractOptions,
    cache: WritableCache,
    spec: dict,
    layout: Layout,
    data: TokenizedData,
    resumed: Resumed,
    ranks: list[tuple[int, str]],
    world: int,
    group: Group | None,
) -> list[RankJob]:
    """The jobs of this process's `ranks` (rank, device) out of `world`."""
    batches = kept_plan(data, layout)  # mapped from a file: each rank lists only its own share
    jobs = []
    for rank, device in ranks:
        mine = shard_for_rank(batches, rank, world, drop_remainder=False)
        samples = data.samples(sid for batch in mine for sid in batch)  # read when the rank needs them
        jobs.append(
            RankJob(
                root=cache.root,
                target_path=Path(opts.target),
                device=device,
                rank=rank,
                spec=spec,
                layout=layout,
                batches=mine,
                samples=samples,
                done=set(samples.ids[resumed.done.has(samples.rows)].tolist()),
                first_shard_index=resumed.next_index.get(rank, 0),
                on_bad_sample=opts.on_bad_sample,
                max_shard_bytes=opts.max_shard_bytes,
                compress_threads=opts.compress_threads or max(2, (os.cpu_count() or 2) // len(ranks)),
                # Again when a run died before journaling their hashes (a head file may be partial).
                write_target_files=rank == 0 and not resumed.target_files_done,
                kernel_cache=opts.kernel_cache,
                uploader=cache.uploader(rank) if group is None or group.writes else None,
                group=group,
            )
        )
    return jobs


def _stop(process) -> None:
    if process is not None and process.is_alive():
        process.kill()


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
