"""The reference drafter implementation: `dflash` 0.1.0 from PyPI as published, imported from the
committed wheel (tests/fixtures/reference/SOURCES.md); nothing is installed."""

import hashlib
import importlib
import sys
from pathlib import Path

REFERENCE = Path(__file__).parents[1] / "fixtures" / "reference" / "dflash-0.1.0-py3-none-any.whl"
REFERENCE_SHA256 = "b3fe38d9413efc30a952c8b38b34f1dcc696ba6d7b865acbf540a34cc53afaa2"


def reference_model_class():
    """The reference's DFlashDraftModel (Python imports pure modules from a zip on sys.path)."""
    assert hashlib.sha256(REFERENCE.read_bytes()).hexdigest() == REFERENCE_SHA256
    sys.path.insert(0, str(REFERENCE))
    try:
        module = importlib.import_module("dflash.model")
    finally:
        sys.path.remove(str(REFERENCE))
    assert module.__file__.startswith(str(REFERENCE)), f"dflash.model was imported from {module.__file__}"
    return module.DFlashDraftModel
