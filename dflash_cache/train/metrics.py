"""What a run reports: a progress line, `RUN/metrics.jsonl` (one JSON object per step and per
evaluation), and TensorBoard event files in `RUN/tb/` when tensorboard is installed. Rank 0 only."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dflash_cache.train.state import TrainState

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"


def progress_line(record: dict, total_steps: int) -> str:
    parts = [
        f"step {record['step']}/{total_steps}",
        f"loss {record['loss']:.4f}",
        f"tau {record['tau']:.3f}",
        f"acc1 {record['acc_1']:.3f}",
        tokens_per_s(record["tokens_per_s"]),
        f"lr {record['lr']:.2e}",
    ]
    if record.get("gpu_mem_gib") is not None:
        parts.append(f"mem {record['gpu_mem_gib']:.1f} GiB")
    if record.get("skipped"):
        parts.append(f"skipped {record['skipped']}")
    return " | ".join(parts)


def tokens_per_s(rate: float) -> str:
    return f"{rate / 1000:,.1f}k tok/s" if rate >= 1000 else f"{rate:,.0f} tok/s"


def eval_line(record: dict) -> str:
    return (
        f"eval @ step {record['step']}: loss {record['eval_loss']:.4f} | tau {record['eval_tau']:.3f} | "
        f"acc1 {record['eval_acc_1']:.3f} | {record['eval_batches']} batches"
    )


def _summary_writer(directory: Path, purge_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional at run time
        return None
    _after_existing_files(directory)
    return SummaryWriter(str(directory), purge_step=purge_step)


def _after_existing_files(directory: Path) -> None:
    """Waits, at most a second, until a new event file's name sorts after the folder's: TensorBoard reads
    the files in name order, which starts with the creation second, then the pid and a counter compared
    as text. A resume within the second of the last file could otherwise be read before it, its purge
    mark first (seen in CI: steps 3-6, then 1-6)."""
    seconds = [
        int(p.name.split(".")[3]) for p in directory.glob("events.out.tfevents.*") if p.name.split(".")[3].isdigit()
    ]
    while seconds and time.time() < max(seconds) + 1:
        time.sleep(0.05)


class MetricsLog:
    """Appends to metrics.jsonl; on resume, lines past the resumed step (written after the
    checkpoint by the interrupted run) are dropped first so the file reads as one run. TensorBoard's
    files are only appended to: the new file starts with a purge mark, which tells TensorBoard to
    drop the earlier files' events past the resumed step."""

    def __init__(
        self, run_dir: Path, total_steps: int, resumed_step: int, echo: Callable[[str], None], log_every: int = 1
    ):
        self.total_steps = total_steps
        self.echo = echo
        self.log_every = log_every
        path = Path(run_dir) / METRICS_FILE
        resumed = path.exists()
        if resumed:
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= resumed_step]
            path.write_text("".join(line + "\n" for line in kept))
        self.file = open(path, "a")  # noqa: SIM115 - open for the whole run, closed by close()
        self.tb = _summary_writer(Path(run_dir) / TENSORBOARD_DIR, resumed_step + 1 if resumed else None)

    def write(self, record: dict, line: str | None) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for name, value in record.items():
                if name != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(name, value, record["step"])
        if line is not None:
            self.echo(line)

    def step(self, record: dict) -> None:
        show = record["step"] % self.log_every == 0 or record["step"] == self.total_steps
        self.write(record, progress_line(record, self.total_steps) if show else None)

    def eval(self, record: dict) -> None:
        self.write(record, eval_line(record))

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a torn last line from a killed run: drop it


class StepMetrics:
    """Each step's and each evaluation's record: written to the run folder on the first rank (`log`),
    dropped on the others."""

    def __init__(self, log: MetricsLog | None, world: int, grad_accum: int, device: torch.device):
        self.log, self.world, self.grad_accum, self.device = log, world, grad_accum, device

    def step(self, stats: list[float], grad_norm: float, lr: float, seconds: float, state: TrainState) -> None:
        """`stats`: the step's sums over micro-batches and ranks (train.py's STATS)."""
        if self.log is None:
            return
        loss, tau_blocks, blocks, hits, counted, tokens = stats
        record = {
            "step": state.step,
            "epoch": state.epoch,
            "loss": loss / (self.world * self.grad_accum),
            "tau": tau_blocks / max(blocks, 1),
            "acc_1": hits / max(counted, 1),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": int(tokens),
            "blocks": int(blocks),
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "step_time_s": seconds,
            "skipped": state.skipped,
        }
        if self.device.type == "cuda":
            record["gpu_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.log.step(record)

    def eval(self, record: dict) -> None:
        if self.log is not None:
            self.log.eval(record)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
