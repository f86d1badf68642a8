"""A drafter config from a preset's name or a JSON file: our own fields, or a reference `config.json`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from dflash_cache.drafter.config import PRESETS, DrafterConfig
from dflash_cache.drafter.reference import config_from_reference
from dflash_cache.errors import DFlashCacheError


def load_drafter_config(name_or_path: str | Path) -> DrafterConfig:
    """A preset by name, or a JSON file: our own fields, or a reference `config.json` (with `dflash_config`)."""
    if str(name_or_path) in PRESETS:
        return replace(PRESETS[str(name_or_path)])
    path = Path(name_or_path)
    if path.suffix == ".json" and not path.exists():
        raise DFlashCacheError(
            f"drafter config {path} does not exist; give a JSON file or a preset ({', '.join(PRESETS)})."
        )
    if not path.is_file():
        raise DFlashCacheError(
            f"drafter config {str(name_or_path)!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON file."
        )
    try:
        values = json.loads(path.read_text())
    except (json.JSONDecodeError, RecursionError) as e:
        raise DFlashCacheError(f"drafter config {path} is not valid JSON: {e}.") from None
    return config_from_file(values, path)


def config_from_file(values: object, path: Path) -> DrafterConfig:
    """The config a JSON file holds (our fields or a reference `config.json`), checked; errors name `path`."""
    try:
        if isinstance(values, dict) and "dflash_config" in values:
            return config_from_reference(values)
        return DrafterConfig.from_dict(values)
    except DFlashCacheError as e:
        raise DFlashCacheError(f"{path}: {e}") from None
