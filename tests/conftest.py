import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.tiny import build_target, build_tokenizer, write_conversations

# Tokenized data goes to a folder of this session (subprocesses inherit it), not the user's cache.
os.environ["DFLASH_CACHE_TOKENIZED_DIR"] = tempfile.mkdtemp(prefix="dflash-cache-tokenized-")

CHECKOUT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    """Tests start the CLI as `python -m dflash_cache_cli.main`, which imports `cli/` from wherever
    this venv's editable install points: a venv made for another worktree runs that worktree's CLI
    against this one's library and tests (a resume test failed so).
    Refuse to start then."""
    import dflash_cache_cli

    found = Path(dflash_cache_cli.__file__).resolve().parent
    if found != CHECKOUT / "cli":
        pytest.exit(
            f"dflash_cache_cli is imported from {found}, not this checkout's {CHECKOUT / 'cli'}: run "
            f"`{sys.executable} -m pip install -e {CHECKOUT}` or use this checkout's venv",
            returncode=4,
        )


def pytest_unconfigure(config):
    shutil.rmtree(os.environ["DFLASH_CACHE_TOKENIZED_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):  # not `in item.keywords`: that holds folder names too (a checkout in gpu/)
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def quick_autotuning(request):
    """GPU tests start from an empty Triton cache: their autotuners work as extraction's warm-up does
    (every configuration compiled at once on threads, each timed in ten runs instead of 125 ms of
    runs), which leaves results alone. Without it a cold run of them did not finish in a GPU test's time; with it, not yet measured.
    Tests of the autotuning itself are marked `own_autotuning`."""
    if "gpu" not in request.keywords or "own_autotuning" in request.keywords or not torch.cuda.is_available():
        yield
        return
    from dflash_cache.target.warmup import compile_threads, parallel_autotune

    with parallel_autotune(compile_threads()):
        yield


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session", params=["qwen3", "qwen3_5"])
def target_dir(request, tmp_path_factory):
    """A tiny random-weight target directory (dense qwen3, then hybrid qwen3_5)."""
    return build_target(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def qwen3_target_dir(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def conversations(tmp_path_factory):
    return write_conversations(tmp_path_factory.mktemp("data") / "conversations.jsonl")
