"""Named fault-injection points for the crash tests.

`DFLASH_CACHE_KILL_AT=NAME:N` makes the process SIGKILL itself the N-th time it passes point NAME
(N defaults to 1). Unset, `point()` is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

_counts: dict[str, int] = {}


def point(name: str) -> None:
    spec = os.environ.get("DFLASH_CACHE_KILL_AT")
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
