"""Extraction as tests run it: the tiny targets' layers and options, a run killed at a fault point, and
two caches compared bit for bit."""

import signal
from pathlib import Path

import pytest
import torch

from dflash_cache import open_cache
from dflash_cache.extract.pipeline import ExtractOptions, extract
from dflash_cache.store.verify import verify_cache
from tests.support.cli import spawn
from tests.support.tiny import build_target, write_conversations

LAYERS = [1, 4]
SHARD_MB = 0.02  # a few shards from a few samples
SHARD_BYTES = int(SHARD_MB * (1 << 20))


def run_extract(target, data, out, **kw):
    opts = ExtractOptions(
        target=target, data=[data], out=out, layers=LAYERS, token_budget=kw.pop("token_budget", 300), **kw
    )
    return extract(opts)


def extract_args(target, data, out):
    return [
        "extract",
        "--target",
        target,
        "--data",
        data,
        "--out",
        out,
        "--layers",
        ",".join(map(str, LAYERS)),
        "--token-budget",
        300,
        "--shard-size",
        SHARD_MB,
    ]


def extract_killed_at(target, data, out, kill_at: str) -> None:
    """The CLI run killed by SIGKILL at the fault point `kill_at` (DFLASH_CACHE_KILL_AT)."""
    proc = spawn(*extract_args(target, data, out), env={"DFLASH_CACHE_KILL_AT": kill_at})
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL


def assert_same_cache(a: Path, b: Path):
    """Bit for bit: a sample is computed in the same batch, in the same shape, whichever run computes
    it. That holds across processes only while they run the same CPU kernels (docs/FAULTS.md, "Not
    covered"); a failure says how far apart the samples are, to tell kernel rounding from a bug."""
    ca, cb = open_cache(a), open_cache(b)
    assert sorted(ca) == sorted(cb)
    for sid in ca:
        x, y = ca[sid], cb[sid]
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        same = torch.equal(x.target_ids, y.target_ids) and torch.equal(
            x.hidden.view(torch.int16), y.hidden.view(torch.int16)
        )
        assert same, describe_difference(sid, x, y)
    verify_cache(cb)


def describe_difference(sid: int, x, y) -> str:
    """Where two versions of one sample differ: the argmax positions and how many hidden values, how far."""
    flips = (x.target_ids != y.target_ids).nonzero().flatten().tolist()
    differ = x.hidden.view(torch.int16) != y.hidden.view(torch.int16)
    tokens = differ.any(-1).nonzero().flatten().tolist()
    gap = float((x.hidden.float() - y.hidden.float()).abs().max())
    return (
        f"sample {sid} ({len(x.input_ids)} tokens): target_ids differ at {flips[:8]} "
        f"({[(int(x.target_ids[i]), int(y.target_ids[i])) for i in flips[:3]]}); {int(differ.sum())} of "
        f"{differ.numel()} hidden values differ, from token {tokens[:1]}, by up to {gap:.3g} "
        f"(values up to {float(x.hidden.float().abs().max()):.3g})"
    )


@pytest.fixture(scope="module")
def reference_extraction(tmp_path_factory):
    """A tiny qwen3 target, 16 conversations and their cache of 13 shards, extracted in this process."""
    root = tmp_path_factory.mktemp("reference")
    target = build_target(root / "target", "qwen3")
    data = write_conversations(root / "data.jsonl", count=16, seed=3)
    reference = root / "reference"
    run_extract(target, data, reference, max_shard_bytes=SHARD_BYTES)
    return target, data, reference
