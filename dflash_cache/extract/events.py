"""`ExtractEvents`: what an extraction reports as it goes, for a caller to display (importable
without torch, so that the command's module can subclass it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash_cache.data.dataset import LoadedData
    from dflash_cache.extract.worker import Progress


class ExtractEvents:
    """What `extract` reports as it goes; each method does nothing unless a caller overrides it."""

    def data(self, loaded: LoadedData) -> None:
        """Once, with the loaded data (bad records, untrainable samples)."""

    def tokenize(self, samples: int, tokens: int) -> None:
        """As data is tokenized (not at all when the tokenized data is kept from an earlier run)."""

    def plan(self, samples: int, tokens: int, layout: str) -> None:
        """Once, with the work left to do and how the target runs it."""

    def progress(self, progress: Progress) -> None:
        """As ranks commit samples."""

    def note(self, line: str) -> None:
        """What was repaired on the way."""
