"""Named fault-injection points for the crash tests.

`DFLASH_CACHE_KILL_AT=NAME:N` makes the process SIGKILL itself the N-th time it passes point NAME
(N defaults to 1); `NAME:N:STOP` sends SIGSTOP instead, freezing the process where it stands (a
test then sees what it holds, and SIGCONT lets it go on). `DFLASH_CACHE_DELAY_AT=NAME:SECONDS` makes
the process sleep that long each time it passes point NAME (an extraction that commits shards slowly,
for a training run that follows it). Unset, `point()` is two dictionary lookups.
"""

from __future__ import annotations

import os
import signal
import time

_counts: dict[str, int] = {}


def point(name: str) -> None:
    delay = os.environ.get("DFLASH_CACHE_DELAY_AT")
    if delay and delay.partition(":")[0] == name:
        time.sleep(float(delay.partition(":")[2]))
    spec = os.environ.get("DFLASH_CACHE_KILL_AT")
    if not spec:
        return
    target, _, rest = spec.partition(":")
    if target != name:
        return
    nth, _, action = rest.partition(":")
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGSTOP if action == "STOP" else signal.SIGKILL)
