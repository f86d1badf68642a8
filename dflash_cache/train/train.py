"""`train`: DFlash drafter training from one or more caches (or a live target), top to bottom.

Precision: forward and backward run under bf16 autocast; AdamW's state and arithmetic are fp32, and so
are the weights a checkpoint stores. On the CPU the weights and gradients are fp32. On a GPU AdamW's
update is compiled (train/optim.py CompiledAdamW) and holds the fp32 master of each matrix, whose bf16
copy is the model's weight: matrix gradients are bf16, and so are their sums over micro-batches
(--grad-accum) and their averages over ranks; norm weights stay fp32. The frozen target head
(embeddings, LM head) is bf16.

Every random draw of a step (the anchors of each batch) is seeded by (seed, epoch, plan position),
so a run's losses depend neither on the number of ranks (for the same ranks x grad-accum) nor on
where it was interrupted and resumed.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from dflash_cache import faults
from dflash_cache.batch import FeatureBatch
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.defaults import describe_drafter
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.errors import DFlashCacheError
from dflash_cache.lock import FolderLock
from dflash_cache.store.pool import default_pool_size
from dflash_cache.store.subspace import spec_basis
from dflash_cache.stream.epochs import (
    EVAL,
    TRAIN,
    EpochPlan,
    batch_seed,
    held_out_batches,
)
from dflash_cache.stream.follow import FollowPlan
from dflash_cache.train.budget import (
    GPU_SHARE,
    available_bytes,
    batch_anchors,
    check_fits,
    default_anchor_cap,
    device_defaults,
    estimate_step_memory,
    head_bytes,
    is_out_of_memory,
    out_of_memory,
)
from dflash_cache.train.checkpoint import (
    checkpoint_step,
    latest_checkpoint,
    load_checkpoint,
    remove_partial,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from dflash_cache.train.config import TrainConfig
from dflash_cache.train.distributed import (
    Rank,
    all_gather_objects,
    all_reduce_sum,
    init_rank,
    launch,
    plan_devices,
    shutdown,
    under_torchrun,
)
from dflash_cache.train.metrics import MetricsLog
from dflash_cache.train.model import build_drafter, drafter_config_for
from dflash_cache.train.optim import build_optimizer, build_scheduler, clipped_step, gradient_norm
from dflash_cache.train.retention import prune_checkpoints
from dflash_cache.train.rundir import prepare_run_dir, run_identity
from dflash_cache.train.source import FollowSource, Source, check_target_gpus, open_source, target_device
from dflash_cache.units import size as gb

Echo = Callable[[str], None]
# Summed over micro-batches and ranks each step: loss, tau * blocks, blocks, slot-1 hits, slot-1 counted, tokens.
STATS = 6


def train(cfg: TrainConfig, echo: Echo = print) -> None:
    """Check everything that can be checked up front, then run every rank (spawned, or this process).
    Options left None (token budget, max anchors) take the defaults of the device type."""
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available() and not cfg.cpu_procs:
            device = f"cuda:{cfg.gpus[local] if cfg.gpus else local}"
        else:
            device = "cpu"
        cfg = with_device_defaults(cfg, torch.device(device).type)
        cfg.check()
        check_target_gpus(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        # Every rank goes on even when the run is finished (its loop is then empty): the others wait for rank 0.
        epoch_steps, lock = (
            prepare(cfg, world, echo) if rank == 0 else (None, None)
        )  # rank 0 alone writes the run folder
        try:
            run_rank(rank, world, device, cfg, echo, local, epoch_steps)
        finally:
            if lock is not None:
                lock.release()
        return
    cfg.check_source()
    devices = plan_devices(cfg.gpus, cfg.cpu_procs)
    cfg = with_device_defaults(cfg, torch.device(devices[0]).type)
    cfg.check()
    check_target_gpus(cfg, len(devices))
    epoch_steps, lock = prepare(cfg, len(devices), echo)
    with lock:
        if epoch_steps is None:
            return
        launch(run_rank, devices, (cfg, echo, None, epoch_steps))


def with_device_defaults(cfg: TrainConfig, device_type: str) -> TrainConfig:
    token_budget, max_anchors = device_defaults(device_type)
    return replace(
        cfg,
        token_budget=token_budget if cfg.token_budget is None else cfg.token_budget,
        max_anchors=max_anchors if cfg.max_anchors is None else cfg.max_anchors,
    )


def prepare(cfg: TrainConfig, world: int, echo: Echo) -> tuple[dict[int, int] | None, FolderLock]:
    """Bad input fails here, before any process is spawned and before the run folder is written:
    source, drafter config, split, plan, then the run folder. Returns the steps of each epoch
    counted, for the ranks not to plan every epoch again (None when there is nothing to do: a
    resumed run that is already finished), and the run folder's lock, to hold for the whole run."""
    source = open_source(cfg, echo=echo)  # a live target's weights are not loaded here
    try:
        source.check()  # first: it checks the target files the drafter config reads
        config, notes = drafter_config_for(cfg.drafter, source.spec, source.tokenizer_dir)
        identity = run_identity(cfg.trajectory(), world, *source.identity(), config.to_dict())
        train_keys, eval_keys = source.split(cfg.eval_fraction)
        plan = make_plan(cfg, source, train_keys, world, None, echo)
        plan_lines = plan.describe(0)  # before the other epochs are counted, while epoch 0 is still cached
        total = plan.total_steps(cfg.epochs, cfg.steps)
        checkpoint, lock = prepare_run_dir(Path(cfg.out), identity, cfg.resume)
        for note in notes:
            echo(f"drafter config: {note}")
        if cfg.max_open_shards is None and (pool_note := default_pool_size()[1]):
            echo(pool_note)
        echo(describe_drafter(config))
        echo(
            f"{source.describe()}: {len(train_keys)} to train on, "
            f"{len(eval_keys)} held out; {world} rank(s), grad accum {cfg.grad_accum}, {total} steps "
            f"of {cfg.token_budget:,} tokens per batch, at most {cfg.max_anchors:,} blocks per sequence"
            + ("" if cfg.anchors_per_batch is None else f" and {cfg.anchors_per_batch:,} per batch")
        )
        for line in plan_lines:
            echo(line)
        if checkpoint is not None:
            done = checkpoint_step(checkpoint)
            if done >= total:
                echo(
                    f"{cfg.out} is finished: {checkpoint.name} is its last step ({total}), nothing to train. To train "
                    "further, start a new run in another --out with more --steps or --epochs."
                )
                return None, lock
            echo(f"resuming from {checkpoint} (step {done} of {total})")
    finally:
        source.close()
    return plan.epoch_steps, lock


def make_plan(
    cfg: TrainConfig,
    source: Source,
    train_keys: list[int],
    world: int,
    epoch_steps: dict[int, int] | None,
    echo: Echo | None,
) -> EpochPlan | FollowPlan:
    """The run's epoch plan: the ordinary one, or one whose first epoch follows the cache (`--follow`)."""
    if isinstance(source, FollowSource):
        return FollowPlan(
            source.followed,
            Path(cfg.out),
            cfg.token_budget,
            cfg.seed,
            world,
            cfg.grad_accum,
            cfg.eval_fraction,
            source.waiter,
        )
    return EpochPlan(train_keys, source.lengths, cfg.token_budget, cfg.seed, world, cfg.grad_accum, epoch_steps)


def run_rank(
    rank: int,
    world: int,
    device: str,
    cfg: TrainConfig,
    echo: Echo,
    local: int | None = None,
    epoch_steps: dict[int, int] | None = None,
) -> None:
    """One rank; `local`: its index on this node (torchrun's LOCAL_RANK; a spawned rank's own index);
    `epoch_steps`: from `prepare` in this run."""
    me = init_rank(rank, world, device, cfg.collective_timeout_s)
    try:
        source = open_source(
            cfg, target_device(cfg, rank if local is None else local, device), echo=echo if rank == 0 else None
        )
        run(me, cfg, echo if me.is_main else None, source, epoch_steps)
    finally:
        shutdown()


def run(
    me: Rank, cfg: TrainConfig, echo: Echo | None, source: Source, epoch_steps: dict[int, int] | None = None
) -> None:
    """This rank's training loop, fed by `source` (closed at the end)."""
    out = Path(cfg.out)
    train_keys, eval_keys = source.split(cfg.eval_fraction)
    plan = make_plan(cfg, source, train_keys, me.world, epoch_steps, echo)
    total = plan.total_steps(cfg.epochs, cfg.steps)
    held_out = held_out_batches(eval_keys, source.lengths, cfg.token_budget, cfg.seed, me.rank, me.world)

    config, _ = drafter_config_for(cfg.drafter, source.spec, source.tokenizer_dir)
    # A followed cache's batches are not known yet: its memory is checked for a batch of one sample filling the budget.
    lengths = (
        [[min(cfg.token_budget, source.spec["max_length"])]]
        if isinstance(plan, FollowPlan)
        else [[source.lengths[k] for k in b] for b in plan.batches(0)]
    )
    per_batch = anchors_per_batch(cfg, config, lengths, me, echo)
    memory = estimate_step_memory(
        config, head_bytes(config), lengths, cfg.max_anchors, me.device.type, training=True, per_batch=per_batch
    )
    have, what = available_bytes(me.device)
    if echo is not None:
        echo(f"memory: {memory.describe()}; {gb(have)} {what}")
    share = me.world if me.device.type == "cpu" else 1  # CPU ranks share this machine's RAM
    check_fits(memory, me.device, cfg.token_budget, cfg.max_anchors, (have // share, what))
    basis = spec_basis(source.spec, source.tokenizer_dir) if config.subspace_rank else None
    model = build_drafter(config, source.head(me.device), me.device, cfg.seed, basis)
    if me.device.type == "cpu":  # the held-out evaluation too (CPU flex-attention runs unfused, holding every score)
        model.attention = "dense"
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay)
    warmup = cfg.warmup if cfg.warmup is not None else int(0.04 * total)
    scheduler = build_scheduler(optimizer, warmup, total, cfg.min_lr_ratio)
    position = {"step": 0, "epoch": 0, "epoch_step": 0, "skipped": 0}
    if cfg.resume:
        restored = load_checkpoint(latest_checkpoint(out), model, optimizer, scheduler)
        position = restored["position"]
        set_rng_state(restored["rng"][me.rank])

    ddp = model
    if me.world > 1:
        # broadcast_buffers off: the buffers (a subspace basis, up to hundreds of MB) are the same on
        # every rank and never change; broadcasting them would cost a copy every forward
        ddp = DistributedDataParallel(
            model, device_ids=[me.device.index] if me.device.type == "cuda" else None, broadcast_buffers=False
        )
    anchor_budget = None
    if cfg.compile:
        anchor_budget = plan.anchor_bound(0, config.block_size, cfg.max_anchors)
        anchor_budget = anchor_budget if per_batch is None else min(anchor_budget, per_batch)
        if echo is not None:
            echo_padding(
                echo, anchor_budget, [batch_anchors(b, config.block_size, cfg.max_anchors, per_batch) for b in lengths]
            )
        token_budget = max(cfg.token_budget, max(source.lengths[k] for k in train_keys))
        runner = DrafterRunner(
            ddp, compiled=True, token_budget=token_budget, anchor_budget=anchor_budget, backend=cfg.compile_backend
        )
    else:
        runner = DrafterRunner(ddp)
    eval_runner = DrafterRunner(model)  # eager and unwrapped: ranks may evaluate different numbers of batches
    if echo is not None and me.device.type == "cuda":
        echo(
            (
                f"the first step compiles the whole drafter for batches padded to {runner.token_budget:,} tokens and "
                f"{anchor_budget:,} anchors"
                if cfg.compile
                else "the first step compiles the drafter's regions (decoder layers, context projection, loss) for "
                "dynamic shapes, once for every batch shape"
            )
            + ", and AdamW's update"
        )

    log = None
    if echo is not None:
        remove_partial(out)
        log = MetricsLog(out, total, position["step"], echo, cfg.log_every)
    saved_at = position["step"]
    try:
        while position["step"] < total:
            epoch, part = position["epoch"], position.get("part", 0)
            batches, offset, last_part = plan.segment(epoch, part, me.rank)
            start = position["epoch_step"] * cfg.grad_accum
            with source.batches(batches[start:], me.device) as loader:
                tick = time.perf_counter()

                def micro_batches(local: int, step: int) -> list[tuple[FeatureBatch, torch.Tensor]] | None:
                    """The batches of the run's step `step` (from 0), at plan position `local` on, with their
                    anchors; None past the epoch or the run."""
                    if local >= len(batches) or step >= total:
                        return None
                    return [
                        with_anchors(
                            next(loader),
                            cfg,
                            me,
                            epoch,
                            offset + plan.global_index(local + i, me.rank),
                            config.block_size,
                            anchor_budget or per_batch,
                        )
                        for i in range(cfg.grad_accum)
                    ]

                micro = micro_batches(start, position["step"])
                for local in range(start, len(batches), cfg.grad_accum):
                    if micro is None:
                        break
                    lr = scheduler.get_last_lr()[0]
                    stats, grad_norm, norm, losses = train_step(runner, ddp, micro, cfg, me, position["step"], source)
                    # Sampling anchors waits for the GPU: here it is idle, whereas after AdamW's launch it would wait
                    # for the update, and the next step's masks and forward would be launched on an idle GPU.
                    upcoming = micro_batches(local + cfg.grad_accum, position["step"] + 1)
                    if not (math.isfinite(stats[0]) and math.isfinite(grad_norm)):
                        handle_nonfinite([b for b, _ in micro], losses, cfg, position["step"] + 1, source)
                        position["skipped"] += 1
                        optimizer.zero_grad(set_to_none=True)
                    else:
                        clipped_step(optimizer, norm, cfg.grad_clip)  # the norm on the device: no copy, no wait
                        optimizer.zero_grad(set_to_none=True)
                    micro = upcoming
                    scheduler.step()
                    position["step"] += 1
                    position["epoch_step"] += 1
                    now = time.perf_counter()
                    if log is not None:
                        log.step(step_record(stats, grad_norm, lr, now - tick, position, me, cfg.grad_accum))
                    faults.point("train.step")
                    step = position["step"]
                    evaluating = step % cfg.eval_every == 0 or step == total
                    if evaluating and isinstance(plan, FollowPlan):  # the held-out samples committed so far
                        eval_keys = source.split(cfg.eval_fraction)[1]
                        held_out = held_out_batches(
                            eval_keys, source.lengths, cfg.token_budget, cfg.seed, me.rank, me.world
                        )
                    if eval_keys and evaluating:  # every rank, even one with no batch
                        result = evaluate(eval_runner, source, held_out, cfg, me, config.block_size, per_batch)
                        if log is not None:
                            log.eval({"step": step, **result})
                    if cfg.save_every and (step % cfg.save_every == 0 or step == total):
                        save(out, model, optimizer, scheduler, position, me, cfg.keep_last)
                        saved_at = step
                    tick = time.perf_counter()
            if position["epoch_step"] * cfg.grad_accum >= len(batches):
                if last_part:
                    position["epoch"] += 1
                    position["part"] = 0
                else:
                    position["part"] = part + 1
                position["epoch_step"] = 0
        if cfg.save_every and saved_at != position["step"]:
            save(out, model, optimizer, scheduler, position, me, cfg.keep_last)
    finally:
        if log is not None:
            log.close()
        source.close()


def anchors_per_batch(cfg: TrainConfig, config, lengths: list[list[int]], me: Rank, echo: Echo | None) -> int | None:
    """--anchors-per-batch; when it is not given, on a GPU where the plan's largest batch would not fit, the
    most anchors per batch that do (budget.default_anchor_cap), the smallest over ranks."""
    if cfg.anchors_per_batch is not None or me.device.type != "cuda":
        return cfg.anchors_per_batch
    total = torch.cuda.get_device_properties(me.device).total_memory
    cap, need = default_anchor_cap(config, lengths, cfg.max_anchors, total)
    caps = [c for c in all_gather_objects(cap) if c is not None]
    if not caps:
        return None
    if echo is not None:
        echo(
            f"the plan's largest batch ({need.tokens:,} tokens, up to {need.blocks:,} blocks) needs about {gb(need.total)} a "
            f"step, more than {GPU_SHARE:.0%} of the GPU's {gb(total)}: each batch trains on at most {min(caps):,} blocks, "
            f"a uniform subset of its own (--anchors-per-batch sets this; --token-budget and --max-anchors change the batches)"
        )
    return min(caps)


def echo_padding(echo: Echo, anchor_budget: int, anchors: list[int]) -> None:
    """Says how much of the compiled drafter's blocks is padding, when it is more than a tenth."""
    mean = sum(anchors) / max(len(anchors), 1)
    if anchor_budget > 1.1 * mean:
        fixed = f": --anchors-per-batch {min(anchors):,} or less gives every batch that count" if min(anchors) else ""
        echo(
            f"the compiled drafter pads every batch to {anchor_budget:,} blocks; this plan's batches get {mean:,.0f} on "
            f"average, so {1 - mean / anchor_budget:.0%} of its block rows are padding (eager mode computes none){fixed}"
        )


def with_anchors(
    batch: FeatureBatch, cfg: TrainConfig, me: Rank, epoch: int, index: int, block_size: int, anchor_cap: int | None
) -> tuple[FeatureBatch, torch.Tensor]:
    """The batch at plan position `index` of `epoch` and its anchors, drawn from that position's seed.
    `anchor_cap`: the most anchors of a batch (the compiled drafter's budget, or --anchors-per-batch)."""
    generator = torch.Generator(me.device).manual_seed(batch_seed(cfg.seed, TRAIN, epoch, index))
    return batch, sample_anchors(batch, block_size, cfg.max_anchors, generator, max_total=anchor_cap)


def train_step(
    runner: DrafterRunner,
    ddp: torch.nn.Module,
    micro: list[tuple[FeatureBatch, torch.Tensor]],
    cfg: TrainConfig,
    me: Rank,
    step: int,
    source: Source,
) -> tuple[list[float], float, torch.Tensor, list[torch.Tensor]]:
    """Forward and backward of this rank's micro-batches (each with its anchors); gradients averaged over
    ranks by DDP. Returns the step's STATS summed over every rank, the gradient norm before clipping (a
    number, and the tensor on the device), and this rank's loss of each micro-batch."""
    stats = torch.zeros(STATS, device=me.device, dtype=torch.float64)
    losses = []
    for i, (batch, anchors) in enumerate(micro):
        last = i == len(micro) - 1
        sync = nullcontext() if last or not isinstance(ddp, DistributedDataParallel) else ddp.no_sync()
        try:
            with sync:
                with torch.autocast(me.device.type, dtype=torch.bfloat16):
                    out = runner(
                        batch, anchors, gamma=cfg.gamma, labels=cfg.labels, loss=cfg.loss, dpace_alpha=cfg.dpace_alpha
                    )
                (out.loss / len(micro)).backward()
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            raise DFlashCacheError(
                out_of_memory(
                    me.device,
                    f"at step {step + 1} on {describe_batch(batch, source)}",
                    cfg.token_budget,
                    cfg.max_anchors,
                )
            ) from None
        stats += torch.stack(
            [
                out.loss.detach().double(),
                (out.tau * out.num_blocks).double(),
                out.num_blocks.double(),
                out.correct[0].double(),
                out.total[0].double(),
                torch.full((), batch.num_tokens, device=me.device, dtype=torch.float64),
            ]
        )  # no host copy: no wait
        losses.append(out.loss.detach())
    norm = gradient_norm(ddp.parameters())
    values = torch.cat([all_reduce_sum(stats), norm.detach().double().reshape(1)]).tolist()
    return values[:STATS], values[STATS], norm, losses


def describe_batch(batch: FeatureBatch, source: Source, limit: int = 16) -> str:
    ids = ", ".join(str(s) for s in batch.sample_ids[:limit]) + (", ..." if len(batch.sample_ids) > limit else "")
    return f"a batch of {batch.num_tokens} tokens in {batch.num_sequences} sequences (sample ids {ids}){source.where}"


def handle_nonfinite(
    batches: list[FeatureBatch], losses: list[torch.Tensor], cfg: TrainConfig, step: int, source: Source
) -> None:
    """Skip the step (--skip-nonfinite) or stop every rank with the same message naming the batches."""
    bad = [describe_batch(b, source) for b, loss in zip(batches, losses) if not torch.isfinite(loss)]
    everywhere = [b for rank_bad in all_gather_objects(bad) for b in rank_bad]
    if cfg.skip_nonfinite:
        return
    what = "; ".join(everywhere) if everywhere else "finite losses but a non-finite gradient norm"
    raise DFlashCacheError(f"non-finite loss at step {step}: {what}; pass --skip-nonfinite to skip such steps")


@torch.no_grad()
def evaluate(
    runner: DrafterRunner,
    source: Source,
    held_out: list[tuple[int, list[int]]],
    cfg: TrainConfig,
    me: Rank,
    block_size: int,
    per_batch: int | None,
) -> dict:
    stats = torch.zeros(STATS, device=me.device, dtype=torch.float64)
    with source.batches([b for _, b in held_out], me.device) as loader:
        for (index, _), batch in zip(held_out, loader):
            generator = torch.Generator(me.device).manual_seed(batch_seed(cfg.seed, EVAL, 0, index))
            anchors = sample_anchors(batch, block_size, cfg.max_anchors, generator, max_total=per_batch)
            try:
                with torch.autocast(me.device.type, dtype=torch.bfloat16):
                    out = runner(
                        batch, anchors, gamma=cfg.gamma, labels=cfg.labels, loss=cfg.loss, dpace_alpha=cfg.dpace_alpha
                    )
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not is_out_of_memory(e):
                    raise
                raise DFlashCacheError(
                    out_of_memory(
                        me.device, f"evaluating {describe_batch(batch, source)}", cfg.token_budget, cfg.max_anchors
                    )
                ) from None
            stats += torch.stack(
                [
                    out.loss.double(),
                    (out.tau * out.num_blocks).double(),
                    out.num_blocks.double(),
                    out.correct[0].double(),
                    out.total[0].double(),
                    torch.tensor(1.0, device=me.device, dtype=torch.float64),
                ]
            )
    loss, tau_blocks, blocks, hits, counted, batches = all_reduce_sum(stats).tolist()
    return {
        "eval_loss": loss / max(batches, 1),
        "eval_tau": tau_blocks / max(blocks, 1),
        "eval_acc_1": hits / max(counted, 1),
        "eval_batches": int(batches),
    }


def step_record(
    stats: list[float], grad_norm: float, lr: float, seconds: float, position: dict, me: Rank, grad_accum: int
) -> dict:
    loss, tau_blocks, blocks, hits, counted, tokens = stats
    record = {
        "step": position["step"],
        "epoch": position["epoch"],
        "loss": loss / (me.world * grad_accum),
        "tau": tau_blocks / max(blocks, 1),
        "acc_1": hits / max(counted, 1),
        "grad_norm": grad_norm,
        "lr": lr,
        "tokens": int(tokens),
        "blocks": int(blocks),
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "step_time_s": seconds,
        "skipped": position["skipped"],
    }
    if me.device.type == "cuda":
        record["gpu_mem_gib"] = torch.cuda.max_memory_allocated(me.device) / 2**30
    return record


def save(out: Path, model, optimizer, scheduler, position: dict, me: Rank, keep_last: int) -> None:
    rngs = all_gather_objects(rng_state())
    if me.is_main:
        save_checkpoint(out, position["step"], model, optimizer, scheduler, dict(position), rngs)
        prune_checkpoints(out, keep_last)
