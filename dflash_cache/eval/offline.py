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
from dflash_cache.drafter.head import TargetHead
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.errors import DFlashCacheError
from dflash_cache.eval.drafters import build_drafter, check_fits, read_drafter, run_caches, run_options, training_run
from dflash_cache.eval.speculative import default_device
from dflash_cache.stream.caches import CacheSet
from dflash_cache.stream.epochs import EVAL, batch_seed, held_out_batches
from dflash_cache.stream.loader import Loader
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
        spec = caches.spec
        check_fits(
            config,
            spec["target"]["hidden_size"],
            spec["target"]["vocab_size"],
            spec["target"]["num_layers"],
            spec["layer_ids"],
        )
        TargetHead.check_shapes(
            caches.head_dir / "head.safetensors", spec["target"]["vocab_size"], spec["target"]["hidden_size"]
        )
        head = TargetHead.load(caches.head_dir / "head.safetensors", device=device)
        # On the CPU the dense-mask attention: flex-attention runs unfused there and holds every score.
        attention = "dense" if device.type == "cpu" else "flex"
        runner = DrafterRunner(build_drafter(config, state, head, device, attention=attention))
        train_keys, held_keys = caches.split(opts.eval_fraction)
        keys = train_keys if opts.eval_fraction == 0 else held_keys
        if not keys:
            raise DFlashCacheError(
                f"--eval-fraction {opts.eval_fraction} holds out no sample of {len(caches)}; raise it."
            )
        if opts.eval_fraction == 0:
            split = "every sample of the cache" + ("" if run else " (the drafter comes from no training run)")
        else:
            whose = f"the held-out split of {run}" if run else "the held-out split"
            split = f"{whose} (--eval-fraction {opts.eval_fraction}, by a hash of the sample id)"
        if run and [c.spec for c in caches.caches] != run_caches(run):
            split += "; this is not the cache the run trained on"
        plan = held_out_batches(keys, caches.lengths, opts.token_budget, opts.seed, rank=0, world=1)
        slots = config.block_size - 1
        tau_sum, blocks, loss = 0.0, 0, 0.0
        correct, total = torch.zeros(slots, dtype=torch.float64), torch.zeros(slots, dtype=torch.float64)
        if opts.loss == "topk" and not spec.get("topk"):
            raise DFlashCacheError(
                "the drafter was trained with --loss topk, whose loss needs the target's top-K labels, "
                "which this cache lacks: evaluate on a cache extracted with --topk K"
            )
        with Loader(caches, [batch for _, batch in plan], device, topk=opts.loss == "topk") as loader:
            for done, ((index, _), batch) in enumerate(zip(plan, loader), 1):
                generator = torch.Generator(device).manual_seed(batch_seed(opts.seed, EVAL, 0, index))
                anchors = sample_anchors(batch, config.block_size, opts.max_anchors, generator)
                try:
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        out = runner(
                            batch,
                            anchors,
                            gamma=opts.gamma,
                            labels=opts.labels,
                            loss=opts.loss,
                            dpace_alpha=opts.dpace_alpha,
                        )
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if not is_out_of_memory(e):
                        raise
                    raise DFlashCacheError(
                        out_of_memory(
                            device,
                            f"on a batch of {batch.num_tokens:,} tokens in {batch.num_sequences} sequences",
                            opts.token_budget,
                            opts.max_anchors,
                        )
                    ) from None
                tau_sum += float(out.tau * out.num_blocks)
                blocks += int(out.num_blocks)
                loss += float(out.loss)
                correct += out.correct.double().cpu()
                total += out.total.double().cpu()
                on_batch(done, len(plan))
    finally:
        caches.close()
    return OfflineReport(
        drafter=source,
        samples=len(keys),
        blocks=blocks,
        tau=tau_sum / max(blocks, 1),
        accuracy=(correct / total.clamp_min(1)).tolist(),
        loss=loss / max(len(plan), 1),
        split=split,
    )
