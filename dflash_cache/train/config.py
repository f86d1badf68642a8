"""`TrainConfig`: every option of a training run, and which of them a resumed run must keep."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dflash_cache.errors import DFlashCacheError


@dataclass
class TrainConfig:
    caches: list[str]  # folders or fsspec URLs (s3://bucket/prefix)
    out: str
    drafter: str = "qwen3.6-27b"  # a preset name or a JSON file of drafter config fields
    gpus: list[int] | None = None  # None: every visible GPU (the CPU when there is none)
    cpu_procs: int = 0  # > 0: train on the CPU with this many processes (gloo DDP), GPUs or not
    epochs: int | None = None  # neither epochs nor steps: one epoch
    steps: int | None = None
    token_budget: int = 49152  # tokens per micro-batch on each rank
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: int | None = None  # warmup steps; None: 4% of the run
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    grad_accum: int = 1
    max_anchors: int = 512
    gamma: float = 7.0  # slot k of a block weighs exp(-(k-1)/gamma) in the loss
    labels: str = "target"  # "target": the target's argmax next token; "tokens": the data's tokens
    compile: bool = False
    compile_backend: str = "inductor"
    eval_fraction: float = 0.01
    eval_every: int = 500
    save_every: int = 1000
    log_every: int = 1  # progress lines (metrics.jsonl gets every step regardless)
    resume: bool = False
    seed: int = 0
    prefetch: int = 4  # batches read ahead on each rank
    workers: int = 8  # reader threads on each rank
    skip_nonfinite: bool = False
    collective_timeout_s: float = 600.0  # a rank stuck this long in a collective is an error
    local_cache: str | None = None  # remote caches: fetch whole shards into this folder (else read byte ranges)
    local_cache_bytes: int | None = None  # at most this many bytes of shards in it, per process

    def check(self) -> None:
        positive = {"token_budget": self.token_budget, "grad_accum": self.grad_accum, "max_anchors": self.max_anchors,
                    "eval_every": self.eval_every, "save_every": self.save_every, "log_every": self.log_every,
                    "prefetch": self.prefetch, "workers": self.workers}
        for name, value in positive.items():
            if value < 1:
                raise DFlashCacheError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
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

    def trajectory(self) -> dict:
        """The options that decide the losses of a run: a resumed run must have the same ones."""
        keep = ("epochs", "steps", "token_budget", "lr", "min_lr_ratio", "warmup", "weight_decay", "grad_clip",
                "grad_accum", "max_anchors", "gamma", "labels", "compile", "eval_fraction", "seed")
        values = asdict(self)
        return {name: values[name] for name in keep}
