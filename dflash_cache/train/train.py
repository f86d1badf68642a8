"""`train`: DFlash drafter training from one or more caches (or a live target), top to bottom.

Precision: forward and backward run under bf16 autocast (in fp32 on a CPU slow at bf16 products:
target/precision.py); the optimizer's state and arithmetic are fp32, and so are the weights a
checkpoint stores. With --optimizer muon (the default: torch's Muon) every weight and gradient stays
fp32. With --optimizer adamw the CPU keeps fp32 weights and gradients; on a GPU AdamW's update is
compiled (train/optim.py CompiledAdamW) and holds the fp32 master of each matrix, whose bf16 copy is the
model's weight: matrix gradients are bf16, and so are their sums over micro-batches (--grad-accum) and
their averages over ranks; norm weights stay fp32. The frozen target head (embeddings, LM head) is in
the step's dtype.

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
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from dflash_cache.console.units import size as gb
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.defaults import describe_drafter
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.errors import DFlashCacheError
from dflash_cache.files import faults
from dflash_cache.files.lock import FolderLock
from dflash_cache.store.pool import default_pool_size
from dflash_cache.store.subspace import spec_basis
from dflash_cache.stream.batch import FeatureBatch
from dflash_cache.stream.epochs import (
    TRAIN,
    EpochPlan,
    batch_seed,
)
from dflash_cache.stream.follow import FollowPlan
from dflash_cache.target.precision import drafter_autocast, forward_dtype
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
    remove_partial,
)
from dflash_cache.train.checkpointer import Checkpointer
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
from dflash_cache.train.evaluator import Evaluator
from dflash_cache.train.metrics import MetricsLog, StepMetrics
from dflash_cache.train.model import build_drafter, drafter_config_for
from dflash_cache.train.optim import build_optimizer, build_scheduler, clipped_step, gradient_norm
from dflash_cache.train.rundir import prepare_run_dir, run_identity
from dflash_cache.train.source import FollowSource, Source, check_target_gpus, open_source, target_device
from dflash_cache.train.state import TrainState

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


@dataclass
class RunPlan:
    """What `prepare` and every rank derive alike from the config and the source."""

    config: DrafterConfig
    notes: list[str]  # how the drafter config was fitted to the source
    train_keys: list[int]
    eval_keys: list[int]
    plan: EpochPlan | FollowPlan
    lines: list[str]  # the plan described, when asked for
    total: int  # steps in the whole run


def plan_run(
    cfg: TrainConfig, source: Source, world: int, epoch_steps: dict[int, int] | None, echo: Echo | None, describe: bool
) -> RunPlan:
    config, notes = drafter_config_for(cfg.drafter, source.spec, source.tokenizer_dir)
    train_keys, eval_keys = source.split(cfg.eval_fraction)
    plan = make_plan(cfg, source, train_keys, world, epoch_steps, echo)
    lines = plan.describe(0) if describe else []  # before the other epochs are counted, while epoch 0 is still cached
    total = plan.total_steps(cfg.epochs, cfg.steps)
    return RunPlan(config, notes, train_keys, eval_keys, plan, lines, total)


def prepare(cfg: TrainConfig, world: int, echo: Echo) -> tuple[dict[int, int] | None, FolderLock]:
    """Bad input fails here, before any process is spawned and before the run folder is written:
    source, drafter config, split, plan, then the run folder. Returns the steps of each epoch
    counted, for the ranks not to plan every epoch again (None when there is nothing to do: a
    resumed run that is already finished), and the run folder's lock, to hold for the whole run."""
    source = open_source(cfg, echo=echo)  # a live target's weights are not loaded here
    try:
        source.check()  # first: it checks the target files the drafter config reads
        planned = plan_run(cfg, source, world, None, echo, describe=True)
        identity = run_identity(cfg.trajectory(), world, *source.identity(), planned.config.to_dict())
        checkpoint, lock = prepare_run_dir(Path(cfg.out), identity, cfg.resume)
        _echo_run(cfg, source, planned, world, echo)
        if checkpoint is not None:
            done, total = checkpoint_step(checkpoint), planned.total
            if done >= total:
                echo(
                    f"{cfg.out} is finished: {checkpoint.name} is its last step ({total}), nothing to train. To train "
                    "further, start a new run in another --out with more --steps or --epochs."
                )
                return None, lock
            echo(f"resuming from {checkpoint} (step {done} of {total})")
    finally:
        source.close()
    return planned.plan.epoch_steps, lock


def _echo_run(cfg: TrainConfig, source: Source, planned: RunPlan, world: int, echo: Echo) -> None:
    for note in planned.notes:
        echo(f"drafter config: {note}")
    if cfg.max_open_shards is None and (pool_note := default_pool_size()[1]):
        echo(pool_note)
    echo(describe_drafter(planned.config))
    echo(
        f"{source.describe()}: {len(planned.train_keys)} to train on, "
        f"{len(planned.eval_keys)} held out; {world} rank(s), grad accum {cfg.grad_accum}, {planned.total} steps "
        f"of {cfg.token_budget:,} tokens per batch, at most {cfg.max_anchors:,} blocks per sequence"
        + ("" if cfg.anchors_per_batch is None else f" and {cfg.anchors_per_batch:,} per batch")
    )
    echo(cfg.describe_optimizer(planned.total))
    for line in planned.lines:
        echo(line)


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
    try:
        trainer = Trainer(me, cfg, echo, source, plan_run(cfg, source, me.world, epoch_steps, echo, describe=False))
        try:
            trainer.fit()
        finally:
            trainer.metrics.close()
    finally:
        source.close()


class Trainer:
    """The drafter, its optimizer and the components that act after each step (metrics, evaluator,
    checkpointer, each on its own cadence), around one loop over the plan's steps."""

    def __init__(self, me: Rank, cfg: TrainConfig, echo: Echo | None, source: Source, planned: RunPlan):
        self.me, self.cfg, self.source, self.plan, self.total = me, cfg, source, planned.plan, planned.total
        config = planned.config
        self.block_size = config.block_size
        # A followed cache's batches are not known yet: its memory is checked for a batch of one sample filling the budget.
        lengths = (
            [[min(cfg.token_budget, source.spec["max_length"])]]
            if isinstance(self.plan, FollowPlan)
            else [[source.lengths[k] for k in b] for b in self.plan.batches(0)]
        )
        self.per_batch = anchors_per_batch(cfg, config, lengths, me, echo)
        _check_memory(cfg, config, lengths, self.per_batch, me, echo)
        basis = spec_basis(source.spec, source.tokenizer_dir) if config.subspace_rank else None
        self.model = build_drafter(config, source.head(me.device), me.device, cfg.seed, basis)
        if (
            me.device.type == "cpu"
        ):  # the held-out evaluation too (CPU flex-attention runs unfused, holding every score)
            self.model.attention = "dense"
        self.optimizer = build_optimizer(self.model, cfg.lr, cfg.weight_decay, cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.warmup_steps(self.total), self.total, cfg.min_lr_ratio)
        out = Path(cfg.out)
        self.checkpointer = Checkpointer(
            out, self.model, self.optimizer, self.scheduler, me, cfg.save_every, cfg.keep_last, self.total
        )
        self.state = self.checkpointer.restore() if cfg.resume else TrainState()
        self.ddp = self.model
        if me.world > 1:
            device_ids = [me.device.index] if me.device.type == "cuda" else None
            # broadcast_buffers off: the buffers (a subspace basis, up to hundreds of MB) are the same on
            # every rank and never change; broadcasting them would cost a copy every forward
            self.ddp = DistributedDataParallel(self.model, device_ids=device_ids, broadcast_buffers=False)
        self.runner, self.anchor_cap = self._runner(lengths, planned.train_keys, echo)
        log = None
        if echo is not None:
            remove_partial(out)
            log = MetricsLog(out, self.total, self.state.step, echo, cfg.log_every)
        self.metrics = StepMetrics(log, me.world, cfg.grad_accum, me.device)
        self.evaluator = Evaluator(
            DrafterRunner(self.model),  # eager and unwrapped: ranks may evaluate different numbers of batches
            source,
            cfg,
            me,
            self.block_size,
            self.per_batch,
            self.total,
            self.metrics,
            planned.eval_keys,
            follow=isinstance(self.plan, FollowPlan),
        )

    def _runner(
        self, lengths: list[list[int]], train_keys: list[int], echo: Echo | None
    ) -> tuple[DrafterRunner, int | None]:
        """The drafter eager, or compiled for one batch shape; and the most anchors of a batch."""
        cfg, me = self.cfg, self.me
        if not cfg.compile:
            runner, anchor_budget = DrafterRunner(self.ddp), None
        else:
            anchor_budget = self.plan.anchor_bound(0, self.block_size, cfg.max_anchors)
            anchor_budget = anchor_budget if self.per_batch is None else min(anchor_budget, self.per_batch)
            if echo is not None:
                anchors = [batch_anchors(b, self.block_size, cfg.max_anchors, self.per_batch) for b in lengths]
                echo_padding(echo, anchor_budget, anchors)
            token_budget = max(cfg.token_budget, max(self.source.lengths[k] for k in train_keys))
            runner = DrafterRunner(
                self.ddp,
                compiled=True,
                token_budget=token_budget,
                anchor_budget=anchor_budget,
                backend=cfg.compile_backend,
            )
        if echo is not None and me.device.type == "cuda":
            echo(
                (
                    f"the first step compiles the whole drafter for batches padded to {runner.token_budget:,} tokens "
                    f"and {anchor_budget:,} anchors"
                    if cfg.compile
                    else "the first step compiles the drafter's regions (decoder layers, context projection, loss) for "
                    "dynamic shapes, once for every batch shape"
                )
                + (", and AdamW's update" if cfg.optimizer == "adamw" else "")
            )
        return runner, anchor_budget or self.per_batch

    def fit(self) -> None:
        while self.state.step < self.total:
            self._train_part()
        self.checkpointer.finish(self.state)

    def _train_part(self) -> None:
        """The steps left in the current part of the current epoch; then the state moves to the next."""
        state, cfg = self.state, self.cfg
        part = state.part
        batches, offset, last_part = self.plan.segment(state.epoch, part, self.me.rank)
        local = state.epoch_step * cfg.grad_accum
        with self.source.batches(batches[local:], self.me.device) as loader:
            tick = time.perf_counter()
            micro = self._micro_batches(loader, batches, offset, local, state.step)
            while micro is not None:
                lr = self.scheduler.get_last_lr()[0]
                stats, grad_norm, norm, losses = train_step(
                    self.runner, self.ddp, micro, cfg, self.me, state.step, self.source
                )
                # Sampling anchors waits for the GPU: here it is idle, whereas after AdamW's launch it would wait
                # for the update, and the next step's masks and forward would be launched on an idle GPU.
                local += cfg.grad_accum
                upcoming = self._micro_batches(loader, batches, offset, local, state.step + 1)
                if not (math.isfinite(stats[0]) and math.isfinite(grad_norm)):
                    handle_nonfinite([b for b, _ in micro], losses, cfg, state.step + 1, self.source)
                    state.skipped += 1
                else:
                    clipped_step(self.optimizer, norm, cfg.grad_clip)  # the norm on the device: no copy, no wait
                self.optimizer.zero_grad(set_to_none=True)
                micro = upcoming
                self.scheduler.step()
                state.step += 1
                state.epoch_step += 1
                self.metrics.step(stats, grad_norm, lr, time.perf_counter() - tick, state)
                faults.point("train.step")
                self.evaluator.after_step(state)
                self.checkpointer.after_step(state)
                tick = time.perf_counter()
        if state.epoch_step * cfg.grad_accum >= len(batches):
            state.epoch, state.part = (state.epoch + 1, 0) if last_part else (state.epoch, part + 1)
            state.epoch_step = 0

    def _micro_batches(
        self, loader, batches: list, offset: int, local: int, step: int
    ) -> list[tuple[FeatureBatch, torch.Tensor]] | None:
        """The batches of the run's step `step` (from 0), at plan position `local` on, with their
        anchors; None past the epoch's part or the run."""
        if local >= len(batches) or step >= self.total:
            return None
        return [
            with_anchors(
                next(loader),
                self.cfg,
                self.me,
                self.state.epoch,
                offset + self.plan.global_index(local + i, self.me.rank),
                self.block_size,
                self.anchor_cap,
            )
            for i in range(self.cfg.grad_accum)
        ]


def _check_memory(
    cfg: TrainConfig,
    config: DrafterConfig,
    lengths: list[list[int]],
    per_batch: int | None,
    me: Rank,
    echo: Echo | None,
) -> None:
    """Refuse a step that would not fit the device, before the drafter is built."""
    work = forward_dtype(me.device).itemsize
    memory = estimate_step_memory(
        config, head_bytes(config, work), lengths, cfg.max_anchors, me.device.type, True, per_batch, work
    )
    have, what = available_bytes(me.device)
    if echo is not None:
        echo(f"memory: {memory.describe()}; {gb(have)} {what}")
    share = me.world if me.device.type == "cpu" else 1  # CPU ranks share this machine's RAM
    check_fits(memory, me.device, cfg.token_budget, cfg.max_anchors, (have // share, what))


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
                with drafter_autocast(me.device):
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
                    f"at step {step + 1} on {source.describe_batch(batch)}",
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


def handle_nonfinite(
    batches: list[FeatureBatch], losses: list[torch.Tensor], cfg: TrainConfig, step: int, source: Source
) -> None:
    """Skip the step (--skip-nonfinite) or stop every rank with the same message naming the batches."""
    bad = [source.describe_batch(b) for b, loss in zip(batches, losses) if not torch.isfinite(loss)]
    everywhere = [b for rank_bad in all_gather_objects(bad) for b in rank_bad]
    if cfg.skip_nonfinite:
        return
    what = "; ".join(everywhere) if everywhere else "finite losses but a non-finite gradient norm"
    raise DFlashCacheError(f"non-finite loss at step {step}: {what}; pass --skip-nonfinite to skip such steps")
