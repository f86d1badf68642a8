"""`no_loading_bars()`: transformers' "Loading weights" bar off while we load a model, and back as
it was afterwards, so that a library caller's own bars are left alone. Our progress lines are the
tool's progress; on a log the bar is carriage-return noise, once per rank."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from transformers.utils import logging as hf_logging

_lock = threading.Lock()
_depth = 0  # loads under way: a live source may load its target on a loader thread while another loads
_was_enabled = False


@contextmanager
def no_loading_bars() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = hf_logging.is_progress_bar_enabled()
            if _was_enabled:
                hf_logging.disable_progress_bar()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                hf_logging.enable_progress_bar()
