"""`evaluate_offline`: τ of a drafter from a cache's hidden states, with no target loaded.

Exactly the trainer's held-out evaluation: the same batch plan (`held_out_batches` with the seed and
token budget), the same anchors (seeded by plan position), the same forward under bf16 autocast, and
τ as the training loss computes it: per block, 1 + the run of leading slots that predict the
target's own next token. Unlike real speculative decoding the context is the data's text rather
than the target's own output, and every block is scored on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dflash_cache.choices import DPACE_ALPHA, LOSSES
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.head import TargetHead
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.errors import DFlashCacheError
from dflash_cache.eval.drafters import build_drafter, check_fits, read_drafter, run_caches, run_options, training_run
from dflash_cache.eval.speculative import default_device
from dflash_cache.stream.caches import CacheSet
from dflash_cache.stream.epochs import EVAL, batch_seed, held_out_batches
from dflash_cache.stream.loader import Loader
from dflash_cache.target.precision import drafter_autocast
from dflash_cache.train.budget import device_defaults, is_out_of_memory, out_of_memory


@dataclass
class OfflineOptions:
    """None: the value of the training run the drafter comes from (its held-out split, batches and
    anchors), or for an export, which has no run, every sample with the device type's defaults."""

    drafter: Path
    caches: list[str | Path]  # folders or fsspec URLs
    eval_fraction: float | None = None  # 0: every sample; else the samples a run with this --eval-fraction holds out
    token_budget: int | None = None
    max_anchors: int | None = None
    seed: int | None = None
    gamma: float | None = None
    labels: str | None = None
    loss: str | None = None
    dpace_alpha: float | None = None
    device: str | None = None

    def resolved(self, run_options: dict, device_type: str) -> OfflineOptions:
        token_budget, max_anchors = device_defaults(device_type)
        fallback = {
            "eval_fraction": 0.0,
            "token_budget": token_budget,
            "max_anchors": max_anchors,
            "seed": 0,
            "gamma": 7.0,
            "labels": "target",
            "loss": LOSSES[0],
            "dpace_alpha": DPACE_ALPHA,
        }
        values = {
            name: getattr(self, name) if getattr(self, name) is not None else run_options.get(name, default)
            for name, default in fallback.items()
        }
        return replace(self, **values)


@dataclass
class OfflineReport:
    drafter: Path
    samples: int
    blocks: int
    tau: float
    accuracy: list[float]  # per slot 1 .. B-1: share of counted slots predicted right (teacher forced)
    loss: float  # mean over batches, as the trainer logs eval_loss
    split: str = ""  # which samples, in words

    def lines(self) -> list[str]:
        return [
            f"samples: {self.split}",
            f"{self.samples} samples, {self.blocks} blocks: tau {self.tau:.3f}, loss {self.loss:.4f}",
            "accuracy per block position 1..{}: {}".format(
                len(self.accuracy), " ".join(f"{a:.2f}" for a in self.accuracy)
            ),
        ]


@torch.no_grad()
def evaluate_offline(
    opts: OfflineOptions, on_batch: Callable[[int, int], None] = lambda done, total: None
) -> OfflineReport:
    device = default_device(opts.device)
    config, state, source = read_drafter(opts.drafter)
    run = training_run(source)
    opts = opts.resolved(run_options(run) if run else {}, device.type)
    caches = CacheSet(opts.caches)
    try:
        runner = _runner(config, state, caches, device)
        keys, split = _keys(opts, caches, run)
        if opts.loss == "topk" and not caches.spec.get("topk"):
            raise DFlashCacheError(
                "the drafter was trained with --loss topk, whose loss needs the target's top-K labels, "
                "which this cache lacks: evaluate on a cache extracted with --topk K"
            )
        plan = held_out_batches(keys, caches.lengths, opts.token_budget, opts.seed, rank=0, world=1)
        sums = _Sums(config.block_size - 1)
        with Loader(caches, [batch for _, batch in plan], device, topk=opts.loss == "topk") as loader:
            for done, ((index, _), batch) in enumerate(zip(plan, loader), 1):
                generator = torch.Generator(device).manual_seed(batch_seed(opts.seed, EVAL, 0, index))
                anchors = sample_anchors(batch, config.block_size, opts.max_anchors, generator)
                sums.add(_forward(runner, batch, anchors, opts, device))
                on_batch(done, len(plan))
    finally:
        caches.close()
    return OfflineReport(
        drafter=source,
        samples=len(keys),
        blocks=sums.blocks,
        tau=sums.tau_sum / max(sums.blocks, 1),
        accuracy=(sums.correct / sums.total.clamp_min(1)).tolist(),
        loss=sums.loss / max(len(plan), 1),
        split=split,
    )


def _runner(config: DrafterConfig, state: dict, caches: CacheSet, device: torch.device) -> DrafterRunner:
    """The drafter on `device`, checked against the cache's target, with the cache's target head."""
    spec = caches.spec
    target = spec["target"]
    check_fits(config, target["hidden_size"], target["vocab_size"], target["num_layers"], spec["layer_ids"])
    TargetHead.check_shapes(caches.head_dir / "head.safetensors", target["vocab_size"], target["hidden_size"])
    head = TargetHead.load(caches.head_dir / "head.safetensors", device=device)
    # On the CPU the dense-mask attention: flex-attention runs unfused there and holds every score.
    attention = "dense" if device.type == "cpu" else "flex"
    return DrafterRunner(build_drafter(config, state, head, device, attention=attention))


def _keys(opts: OfflineOptions, caches: CacheSet, run: Path | None) -> tuple[list[int], str]:
    """The samples evaluated (held out, or all with --eval-fraction 0) and the words that say which."""
    train_keys, held_keys = caches.split(opts.eval_fraction)
    keys = train_keys if opts.eval_fraction == 0 else held_keys
    if not keys:
        raise DFlashCacheError(f"--eval-fraction {opts.eval_fraction} holds out no sample of {len(caches)}; raise it.")
    if opts.eval_fraction == 0:
        split = "every sample of the cache" + ("" if run else " (the drafter comes from no training run)")
    else:
        whose = f"the held-out split of {run}" if run else "the held-out split"
        split = f"{whose} (--eval-fraction {opts.eval_fraction}, by a hash of the sample id)"
    if run and [c.spec for c in caches.caches] != run_caches(run):
        split += "; this is not the cache the run trained on"
    return keys, split


def _forward(runner: DrafterRunner, batch, anchors: torch.Tensor, opts: OfflineOptions, device: torch.device):
    try:
        with drafter_autocast(device):
            return runner(
                batch, anchors, gamma=opts.gamma, labels=opts.labels, loss=opts.loss, dpace_alpha=opts.dpace_alpha
            )
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        where = f"on a batch of {batch.num_tokens:,} tokens in {batch.num_sequences} sequences"
        raise DFlashCacheError(out_of_memory(device, where, opts.token_budget, opts.max_anchors)) from None


class _Sums:
    """The batches' sums: tau x blocks, blocks, loss, and the hits and counts of each block slot."""

    def __init__(self, slots: int):
        self.tau_sum, self.blocks, self.loss = 0.0, 0, 0.0
        self.correct = torch.zeros(slots, dtype=torch.float64)
        self.total = torch.zeros(slots, dtype=torch.float64)

    def add(self, out) -> None:
        self.tau_sum += float(out.tau * out.num_blocks)
        self.blocks += int(out.num_blocks)
        self.loss += float(out.loss)
        self.correct += out.correct.double().cpu()
        self.total += out.total.double().cpu()
