"""`TrainConfig`: every option of a training run, and which of them a resumed run must keep."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dflash_cache.choices import DEFAULT_LOSS, DPACE_ALPHA, LOSSES
from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.remote import is_remote


@dataclass
class TrainConfig:
    out: str
    caches: list[str] = field(default_factory=list)  # folders or fsspec URLs (s3://bucket/prefix)
    # Instead of caches, a live target (the coupled baseline): it computes every batch beside the drafter.
    live_target: str | None = None  # a Hugging Face model directory
    data: list[str] = field(default_factory=list)  # the data files it runs over, as for extract
    layers: list[int] | None = None  # the target layers to feed the drafter (or num_draft_layers)
    num_draft_layers: int | None = None
    target_gpus: list[int] | None = None  # the target's GPU for each local rank; None: each rank's own device
    max_length: int = 8192
    exact_target: bool = (
        False  # one sample per target forward: bit-exact against a --batching padded --token-budget 1 cache
    )
    drafter: str = "target"  # "target" (the target's own shape), a preset name or a JSON file of config fields
    gpus: list[int] | None = None  # None: every visible GPU (the CPU when there is none)
    cpu_procs: int = 0  # > 0: train on the CPU with this many processes (gloo DDP), GPUs or not
    epochs: int | None = None  # neither epochs nor steps: one epoch
    steps: int | None = None
    token_budget: int | None = None  # tokens per micro-batch on each rank; None: the device type's default
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: int | None = None  # warmup steps; None: 4% of the run
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    grad_accum: int = 1
    max_anchors: int | None = None  # blocks per sequence; None: the device type's default
    # blocks per micro-batch, a uniform subset; None: no cap, except on a GPU where the plan's batches would not fit
    anchors_per_batch: int | None = None
    gamma: float = 7.0  # slot k of a block weighs exp(-(k-1)/gamma) in the loss
    labels: str = "target"  # "target": the target's argmax next token; "tokens": the data's tokens
    loss: str = DEFAULT_LOSS  # the training objective, one of LOSSES (drafter/loss.py)
    dpace_alpha: float = DPACE_ALPHA  # with loss "dpace": each slot's confidence q counts as alpha + (1 - alpha) q
    compile: bool = False
    compile_backend: str = "inductor"
    eval_fraction: float = 0.01
    eval_every: int = 500
    save_every: int = 1000  # 0: no checkpoints at all (a throughput experiment; it cannot be resumed)
    keep_last: int = 0  # keep only the newest N complete checkpoints; 0: every one
    log_every: int = 1  # progress lines (metrics.jsonl gets every step regardless)
    resume: bool = False
    seed: int = 0
    prefetch: int = 4  # batches read ahead on each rank
    workers: int = 8  # reader threads on each rank
    skip_nonfinite: bool = False
    collective_timeout_s: float = 600.0  # a rank stuck this long in a collective is an error
    local_cache: str | None = None  # remote caches: fetch whole shards into this folder (else read byte ranges)
    local_cache_bytes: int | None = None  # at most this many bytes of shards in it, per process
    max_open_shards: int | None = None  # shard files open at once on each rank; None: store.pool's default_pool_size
    follow: bool = False  # the first epoch follows the cache while its extraction writes it (stream/follow.py)
    follow_timeout_s: float | None = None  # with follow: the longest wait for a new shard; None: no limit

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
        if self.loss != LOSSES[0]:  # likewise: the runs that record no loss trained with LOSSES[0]
            kept["loss"] = self.loss
            if self.loss == "dpace":
                kept["dpace_alpha"] = self.dpace_alpha
        return kept
