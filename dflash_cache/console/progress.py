"""Progress as plain lines, for runs whose stderr is a log (nohup, Slurm, `| tee`), where tqdm
shows nothing: a line every `every_s` seconds from a background thread, so that a run shows it is
alive even while no batch completes (the target loading, a long batch)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dflash_cache.console.units import size


def duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLog:
    """Counts samples, tokens and bytes written against the totals (None: not known, no ETA);
    `start()` begins the lines, `close()` prints the last one. `writes`: whether bytes are shown."""

    def __init__(
        self,
        what: str,
        total_samples: int | None,
        total_tokens: int | None,
        echo: Callable[[str], None],
        every_s: float = 30.0,
        writes: bool = True,
    ):
        self.what = what
        self.writes = writes
        self.total_samples = total_samples
        self.total_tokens = total_tokens
        self.echo = echo
        self.every_s = every_s
        self.samples = self.tokens = self.bytes = 0
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, samples: int = 0, tokens: int = 0, bytes: int = 0) -> None:
        with self._lock:
            self.samples += samples
            self.tokens += tokens
            self.bytes += bytes

    def line(self) -> str:
        with self._lock:
            samples, tokens, written = self.samples, self.tokens, self.bytes
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = tokens / elapsed
        total = "" if self.total_samples is None else f"/{self.total_samples:,}"
        parts = [f"{self.what}: {samples:,}{total} samples", f"{rate:,.0f} tokens/s"]
        if self.writes:
            parts.append(f"{size(written)} written")
        parts.append(f"{duration(elapsed)} elapsed")
        if self.total_tokens is not None:
            parts.append(f"ETA {duration((self.total_tokens - tokens) / rate) if rate > 0 else 'unknown'}")
        return ", ".join(parts)

    def start(self) -> ProgressLog:
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True, name="progress-log")
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.echo(self.line())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.echo(self.line())
