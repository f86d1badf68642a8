"""`TrainConfig`: every option of a training run, and which of them a resumed run must keep."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dflash_cache.choices import (
    DEFAULT_LOSS,
    DEFAULT_OPTIMIZER,
    DPACE_ALPHA,
    LAYER_RULE,
    LOSSES,
    OPTIMIZER_DEFAULTS,
    OPTIMIZERS,
)
from dflash_cache.console.options import option
from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.pool import DEFAULT_MAX_OPEN_SHARDS
from dflash_cache.store.remote import is_remote

# (token budget, max anchors per sequence). On a GPU the reference settings; on the CPU the attention
# is computed against a dense mask over the whole packed batch, so its cost grows with
# (anchors x block) x tokens: small batches and few blocks per sequence keep a step under a second.
GPU_DEFAULTS = (49152, 512)
CPU_DEFAULTS = (2048, 8)
LIVE = "With --live-target: "


def per_optimizer(index: int) -> str:
    """`--help`'s words for an option whose default depends on --optimizer (OPTIMIZER_DEFAULTS[name][index])."""
    return ", ".join(f"{values[index]:g} with {name}" for name, values in OPTIMIZER_DEFAULTS.items())


@dataclass(kw_only=True)
class TrainConfig:
    caches: list[str] = field(
        default_factory=list,
        metadata=option(
            "Cache directory written by `extract`, or its fsspec URL (s3://bucket/prefix). Repeat to train on the "
            "union of several caches (same target, layers, codec and tokenizer).",
            flag="--cache",
        ),
    )
    live_target: str | None = field(  # a Hugging Face model directory
        default=None,
        metadata=option(
            "Instead of --cache: a Hugging Face model directory run beside the drafter, computing every batch as "
            "coupled pipelines do (the baseline a cache is measured against). Needs --data.",
            path=True,
        ),
    )
    data: list[str] = field(
        default_factory=list,
        metadata=option(
            LIVE + "the data files, as for `extract --data` (conversations JSONL or pre-tokenized "
            "Parquet/Arrow/JSONL). Repeatable."
        ),
    )
    layers: list[int] | None = field(
        default=None,
        metadata=option(LIVE + "target layers to feed the drafter, e.g. 1,16,31,46,61 (as for extract)."),
    )
    num_draft_layers: int | None = field(default=None, metadata=option(LIVE + LAYER_RULE))
    target_gpus: list[int] | None = field(
        default=None,
        metadata=option(
            LIVE + "the GPU of each training rank's own copy of the target, in --gpus order (--target-gpus 0 "
            "--gpus 1: target on GPU 0 feeding the drafter on GPU 1). Default: each rank's training GPU."
        ),
    )
    max_length: int = field(default=8192, metadata=option(LIVE + "longer samples are truncated (as for extract)."))
    exact_target: bool = field(
        default=False,
        metadata=option(
            LIVE + "run each sample alone through the target, as `extract --batching padded --token-budget 1` "
            "does, so the losses equal those of training from such a bf16-zstd cache bit for bit (slower). "
            "Default: a batch's samples in padded target forwards of at most --token-budget tokens."
        ),
    )
    out: str = field(
        metadata=option(
            "Run directory: metrics.jsonl, TensorBoard files in tb/, checkpoints/step-N/. Must be new or empty, "
            "unless --resume.",
            path=True,
        )
    )
    drafter: str = field(
        default="target",
        metadata=option(
            "Drafter shape. 'target': the target's own hidden size, FFN size, heads, KV heads and head_dim, 5 "
            "layers, block 16 (the rule the z-lab DFlash drafters follow). A preset (qwen3-8b, qwen3.6-27b: those "
            "drafters' shapes, with the cache's hidden size, vocabulary and layers), or a JSON file of drafter "
            "fields (README: 'Drafter JSON')."
        ),
    )
    gpus: list[int] | None = field(
        default=None,
        metadata=option(
            "GPUs to train on, one DDP process each, e.g. 5-7. Default: every visible GPU; the CPU when there is "
            "none. Under torchrun, the GPU of each local rank."
        ),
    )
    cpu_procs: int = 0  # > 0: train on the CPU with this many processes (gloo DDP), GPUs or not
    epochs: int | None = field(
        default=None, metadata=option("Passes over the training samples. Default: 1 (unless --steps).")
    )
    steps: int | None = field(default=None, metadata=option("Optimizer steps to run instead of whole epochs."))
    token_budget: int | None = field(
        default=None,
        metadata=option(
            "Tokens per batch on each GPU (packed, no padding in eager mode). "
            f"Default: {GPU_DEFAULTS[0]} on a GPU, {CPU_DEFAULTS[0]} on the CPU."
        ),
    )
    optimizer: str = field(
        default=DEFAULT_OPTIMIZER,
        metadata=option(
            "muon: torch's Muon over the drafter's matrices and AdamW over its norms, as speculators 0.9.0 "
            "trains; or adamw over both.",
            choices=OPTIMIZERS,
        ),
    )
    lr: float | None = field(default=None, metadata=option(f"Peak learning rate. Default: {per_optimizer(0)}."))
    warmup: int | None = field(
        default=None, metadata=option("Linear warmup steps before the cosine decay. Default: 4% of the run.")
    )
    min_lr_ratio: float = field(default=0.1, metadata=option("The cosine ends at lr times this."))
    weight_decay: float | None = field(
        default=None, metadata=option(f"Weight decay of the matrices (norms: none). Default: {per_optimizer(1)}.")
    )
    grad_clip: float = field(default=1.0, metadata=option("Clip the gradient norm to this."))
    grad_accum: int = field(
        default=1,
        metadata=option("Batches per GPU per optimizer step; the global batch is GPUs x this x --token-budget."),
    )
    max_anchors: int | None = field(
        default=None,
        metadata=option(
            f"Most training blocks per sequence. Default: {GPU_DEFAULTS[1]} on a GPU, {CPU_DEFAULTS[1]} on the CPU "
            "(whose attention cost grows with blocks x tokens of a batch)."
        ),
    )
    anchors_per_batch: int | None = field(
        default=None,
        metadata=option(
            "Most training blocks per batch: a uniform subset of the blocks its sequences get (--max-anchors each). "
            "A fixed count is what --compile needs to pad nothing. Default: no cap, except on a GPU where the "
            "plan's largest batch would not fit in memory: then the most that fit, printed at the start."
        ),
    )
    gamma: float = field(default=7.0, metadata=option("Loss weight of block slot k is exp(-(k-1)/gamma)."))
    labels: str = field(
        default="target",
        metadata=option(
            "Train on the target's own next-token predictions, or on the data's tokens.", choices=("target", "tokens")
        ),
    )
    loss: str = field(
        default=DEFAULT_LOSS,
        metadata=option(
            "Training objective. dflash: cross-entropy against the labels, slot k weighted exp(-(k-1)/gamma). "
            "dpace: the same cross-entropy weighted by D-PACE's confidence-derived slot weights (see "
            "--dpace-alpha). topk: distil the target's top-K distribution, as a cache extracted with --topk K "
            "stores it (renormalised over the K tokens), slots weighted as dflash weighs them.",
            choices=LOSSES,
        ),
    )
    dpace_alpha: float = field(
        default=DPACE_ALPHA,
        metadata=option(
            "With --loss dpace: each slot's confidence q counts as alpha + (1 - alpha) * q, in (0, 1]; 1 weighs "
            "every slot by the counted slots from it on."
        ),
    )
    compile: bool = field(
        default=False,
        metadata=option(
            "Run the drafter under torch.compile, batches padded to a fixed size (one graph): the token budget, "
            "and the most blocks a batch of the plan can get (--anchors-per-batch caps it). Faster than eager "
            "only when batches get about that many blocks; the start says how much is padding."
        ),
    )
    compile_backend: str = "inductor"
    eval_fraction: float = field(
        default=0.01,
        metadata=option("Share of samples held out for evaluation, chosen by a hash of the sample id."),
    )
    eval_every: int = field(default=500, metadata=option("Evaluate every N steps (and at the end)."))
    save_every: int = field(
        default=1000,
        metadata=option(
            "Checkpoint every N steps (and at the end); 0: never, for throughput experiments (such a run cannot "
            "be resumed)."
        ),
    )
    keep_last: int = field(
        default=0, metadata=option("Keep only the newest N complete checkpoints (0: keep every one).")
    )
    log_every: int = field(
        default=1, metadata=option("Print a progress line every N steps (metrics.jsonl gets every step).")
    )
    resume: bool = field(
        default=False, metadata=option("Continue the run in --out from its newest complete checkpoint.")
    )
    seed: int = field(default=0, metadata=option("Seed of the batch plan, anchors and initial weights."))
    prefetch: int = field(default=4, metadata=option("Batches read and decompressed ahead, per GPU."))
    workers: int = field(default=8, metadata=option("Reader threads per GPU."))
    skip_nonfinite: bool = field(
        default=False,
        metadata=option("Skip a step whose loss is NaN/Inf (counted in the metrics) instead of stopping."),
    )
    collective_timeout_s: float = field(
        default=600.0,
        metadata=option(
            "Seconds a rank may wait in a collective before the run is stopped as hung.", flag="--collective-timeout"
        ),
    )
    local_cache: str | None = field(
        default=None,
        metadata=option(
            "With a remote --cache: fetch whole shards into this folder and read them there (default: read each "
            "sample by byte ranges).",
            path=True,
        ),
    )
    local_cache_bytes: int | None = field(
        default=None,
        metadata=option(
            "GiB of shards --local-cache may hold per process; least recently used shards are deleted past it.",
            flag="--local-cache-size",
            unit=1 << 30,
        ),
    )
    max_open_shards: int | None = field(
        default=None,
        metadata=option(
            "Shard files each GPU's readers keep open (least recently used closed first): one file descriptor and "
            f"one memory map each, whatever the number of shards (default: {DEFAULT_MAX_OPEN_SHARDS}, or a quarter "
            "of `ulimit -n` where that is lower)."
        ),
    )
    follow: bool = field(
        default=False,
        metadata=option(
            "Start while the cache is still being extracted: the first epoch trains on each shard once it is "
            "committed, waiting for the next one (and saying so); later epochs use the whole cache. Needs --steps."
        ),
    )
    follow_timeout_s: float | None = field(
        default=None,
        metadata=option(
            "With --follow: stop with an error after this many seconds without a new shard. Default: wait on.",
            flag="--follow-timeout",
        ),
    )

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise DFlashCacheError(f"--optimizer must be one of {', '.join(OPTIMIZERS)} (got {self.optimizer!r})")
        lr, weight_decay = OPTIMIZER_DEFAULTS[self.optimizer]
        self.lr = lr if self.lr is None else self.lr
        self.weight_decay = weight_decay if self.weight_decay is None else self.weight_decay

    def warmup_steps(self, total_steps: int) -> int:
        return self.warmup if self.warmup is not None else int(0.04 * total_steps)

    def describe_optimizer(self, total_steps: int) -> str:
        norms = "; AdamW on the norms" if self.optimizer == "muon" else ""
        return (
            f"optimizer: {self.optimizer} (lr {self.lr:g}, weight decay {self.weight_decay:g}{norms}), "
            f"{self.warmup_steps(total_steps)} warmup steps, then a cosine to lr {self.lr * self.min_lr_ratio:g}"
        )

    def check(self) -> None:
        self.check_source()
        positive = {
            "token_budget": self.token_budget,
            "grad_accum": self.grad_accum,
            "max_anchors": self.max_anchors,
            "anchors_per_batch": 1 if self.anchors_per_batch is None else self.anchors_per_batch,
            "eval_every": self.eval_every,
            "log_every": self.log_every,
            "prefetch": self.prefetch,
            "workers": self.workers,
            "max_open_shards": 1 if self.max_open_shards is None else self.max_open_shards,
        }
        for name, value in positive.items():
            if value < 1:
                raise DFlashCacheError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
        self._check_schedule()
        self._check_objective()
        self._check_devices()

    def _check_schedule(self) -> None:
        if self.keep_last < 0:
            raise DFlashCacheError(f"--keep-last must be at least 0 (got {self.keep_last})")
        if self.save_every < 0:
            raise DFlashCacheError(f"--save-every must be at least 0 (got {self.save_every})")
        if self.epochs is not None and self.steps is not None:
            raise DFlashCacheError("give --epochs or --steps, not both")
        for name in ("epochs", "steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise DFlashCacheError(f"--{name} must be at least 1 (got {value})")
        if not 0 <= self.eval_fraction < 1:
            raise DFlashCacheError(f"--eval-fraction must be in [0, 1) (got {self.eval_fraction})")
        if self.lr <= 0:
            raise DFlashCacheError(f"--lr must be positive (got {self.lr})")
        if self.warmup is not None and self.warmup < 0:
            raise DFlashCacheError(f"--warmup must be at least 0 (got {self.warmup})")
        if self.seed < 0:
            raise DFlashCacheError(f"--seed must be at least 0 (got {self.seed})")

    def _check_objective(self) -> None:
        if self.labels not in ("target", "tokens"):
            raise DFlashCacheError(f"--labels must be target or tokens (got {self.labels!r})")
        if self.loss not in LOSSES:
            raise DFlashCacheError(f"--loss must be one of {', '.join(LOSSES)} (got {self.loss!r})")
        if self.loss == "topk" and self.labels != "target":
            raise DFlashCacheError("--loss topk distils the target's own distribution; it needs --labels target")
        if not 0 < self.dpace_alpha <= 1:
            raise DFlashCacheError(f"--dpace-alpha must be in (0, 1] (got {self.dpace_alpha})")
        if self.gamma <= 0:
            raise DFlashCacheError(f"--gamma must be positive (got {self.gamma})")
        if self.grad_clip <= 0:  # a negative norm would flip the gradients' sign
            raise DFlashCacheError(f"--grad-clip must be positive (got {self.grad_clip})")
        if self.weight_decay < 0:
            raise DFlashCacheError(f"--weight-decay must be at least 0 (got {self.weight_decay})")
        if not 0 <= self.min_lr_ratio <= 1:
            raise DFlashCacheError(f"--min-lr-ratio must be in [0, 1] (got {self.min_lr_ratio})")

    def _check_devices(self) -> None:
        if self.collective_timeout_s <= 0:
            raise DFlashCacheError(f"--collective-timeout must be positive (got {self.collective_timeout_s})")
        if self.cpu_procs < 0:
            raise DFlashCacheError(f"cpu_procs must be at least 0 (got {self.cpu_procs})")
        if self.local_cache_bytes is not None and self.local_cache_bytes < 1:
            raise DFlashCacheError(f"--local-cache-size must be positive (got {self.local_cache_bytes} bytes)")
        if self.gpus is not None and not self.gpus:
            raise DFlashCacheError("--gpus is empty; name at least one GPU, or leave it out to use every visible GPU")
        if self.gpus is not None and len(set(self.gpus)) != len(self.gpus):
            raise DFlashCacheError(f"--gpus lists a GPU twice: {self.gpus}")

    def check_source(self) -> None:
        """Exactly one of --cache and --live-target, and the options of the other one left out."""
        if self.caches and self.live_target is not None:
            raise DFlashCacheError("give --cache or --live-target, not both")
        if self.live_target is None:
            if not self.caches:
                raise DFlashCacheError("give --cache CACHE, or --live-target MODEL_DIR with --data FILE")
            live_only = {
                "data": self.data,
                "layers": self.layers,
                "num_draft_layers": self.num_draft_layers,
                "target_gpus": self.target_gpus,
                "exact_target": self.exact_target,
            }
            if given := [name for name, value in live_only.items() if value]:
                raise DFlashCacheError(f"--{given[0].replace('_', '-')} applies only with --live-target")
            if self.follow:
                self.check_follow()
            elif self.follow_timeout_s is not None:
                raise DFlashCacheError("--follow-timeout applies only with --follow")
            if self.local_cache is not None and not any(is_remote(c) for c in self.caches):
                raise DFlashCacheError(
                    "--local-cache applies only with a remote --cache (s3://...); a local cache is read in place"
                )
            return
        if not self.data:
            raise DFlashCacheError("--live-target needs --data FILE: the samples the target runs over")
        if self.loss == "topk":
            raise DFlashCacheError(
                "--loss topk reads the target's top-K labels from a cache extracted with --topk K; "
                "--live-target computes none: use --cache, or --loss dflash or dpace"
            )
        if self.local_cache is not None:
            raise DFlashCacheError("--local-cache applies only with --cache")
        if self.follow:
            raise DFlashCacheError("--follow follows a cache under extraction; it applies only with --cache")
        if self.target_gpus is not None and not self.target_gpus:
            raise DFlashCacheError("--target-gpus is empty; name one GPU per training rank, or leave it out")
        if self.max_length < 2:
            raise DFlashCacheError(f"--max-length must be at least 2 (got {self.max_length})")

    def check_follow(self) -> None:
        if len(self.caches) != 1:
            raise DFlashCacheError(
                f"--follow follows one cache (got {len(self.caches)}); train on the others once finished"
            )
        if self.steps is None:
            raise DFlashCacheError(
                "--follow needs --steps: the learning-rate schedule needs the run's length, and the "
                "cache's size is not known before its extraction ends"
            )
        if self.compile:
            raise DFlashCacheError(
                "--follow trains eagerly: the compiled drafter is sized from the whole first epoch, "
                "which is not known before the extraction ends; leave out --compile"
            )
        if self.follow_timeout_s is not None and self.follow_timeout_s <= 0:
            raise DFlashCacheError(f"--follow-timeout must be positive (got {self.follow_timeout_s})")

    def trajectory(self) -> dict:
        """The options that decide the losses of a run: a resumed run must have the same ones."""
        keep = (
            "epochs",
            "steps",
            "token_budget",
            "lr",
            "min_lr_ratio",
            "warmup",
            "weight_decay",
            "grad_clip",
            "grad_accum",
            "max_anchors",
            "gamma",
            "labels",
            "compile",
            "eval_fraction",
            "seed",
        )
        values = asdict(self)
        kept = {name: values[name] for name in keep}
        if self.anchors_per_batch is not None:  # absent from the runs that predate it, which can still resume
            kept["anchors_per_batch"] = self.anchors_per_batch
        if self.follow:  # likewise
            kept["follow"] = True
        if self.optimizer != OPTIMIZERS[0]:  # likewise
            kept["optimizer"] = self.optimizer
        if self.loss != LOSSES[0]:  # likewise: the runs that record no loss trained with LOSSES[0]
            kept["loss"] = self.loss
            if self.loss == "dpace":
                kept["dpace_alpha"] = self.dpace_alpha
        return kept
