"""`TrainState`: where a run stands, saved in every checkpoint and restored on resume."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    part: int = 0  # the part of the epoch being trained (a followed cache's first epoch comes in parts)
    epoch_step: int = 0  # steps done in this part of the epoch
    skipped: int = 0  # steps skipped for a non-finite loss (--skip-nonfinite)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> TrainState:
        """From a checkpoint's `position`; a field it lacks (`part`, before any epoch ended) is 0."""
        return cls(**{f.name: int(saved.get(f.name, 0)) for f in fields(cls)})
