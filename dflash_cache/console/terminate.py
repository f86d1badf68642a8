"""SIGTERM (what Slurm, Kubernetes and `kill` send) as an exception, so that cleanup runs.

By default SIGTERM ends Python at once: no `finally`, no `with` exit. Inside `sigterm_raises()` it
raises `Terminated` in the main thread instead, which the CLI reports as `error: terminated` (exit 143).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(BaseException):
    """SIGTERM arrived; a BaseException so that `except Exception` handlers let it through."""


def _raise(signum, frame) -> None:
    raise Terminated()


@contextmanager
def sigterm_raises() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
