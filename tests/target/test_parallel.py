"""A target split over two processes by transformers' tensor parallelism (torchrun, gloo on the CPU)
stores what one process stores, up to bf16 rounding: the split matmuls sum their halves in another order."""

import os
import subprocess
import sys

import pytest

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.extract.pipeline import ExtractOptions, extract
from dflash_cache.store.manifest import spec_differences
from dflash_cache.stream.caches import FREE_SPEC_FIELDS
from dflash_cache.target.parallel import check_fits, group_of
from dflash_cache.train.distributed import free_port
from tests.support.extract import LAYERS, assert_same_cache, extract_args
from tests.support.tiny import build_target, write_conversations

TOLERANCE = 0.03  # of each layer's largest state, as in test_families.py


def test_tp_outside_torchrun_or_over_another_process_count_is_refused(tmp_path):
    with pytest.raises(DFlashCacheError, match="--tp 2 splits the target over the processes of a torchrun launch"):
        extract(ExtractOptions(target=tmp_path, data=[], out=tmp_path / "cache", tp=2))
    with pytest.raises(DFlashCacheError, match="--tp 2 with 4 processes.*--nproc-per-node 2"):
        group_of(0, 4, 2)
    assert group_of(1, 2, 2).writes is False and group_of(0, 2, 2).writes is True


def test_a_target_too_large_for_one_gpu_is_refused_naming_the_split_that_fits():
    """bf16 weights may take 80% of a GPU: 35B parameters are 70 GB, over 80% of 80 GiB (68.7 GB),
    so two GPUs; 120B are 240 GB, 3.5 GPUs' share, so four."""
    gib80 = 80 * 2**30
    with pytest.raises(DFlashCacheError, match="35.0B parameters take 65 GiB.*--nproc-per-node 2 .* --tp 2"):
        check_fits(35_000_000_000, gib80, 1)
    check_fits(35_000_000_000, gib80, 2)
    check_fits(8_000_000_000, gib80, 1)
    with pytest.raises(DFlashCacheError, match="112 GiB per process at --tp 2.*--tp 4"):
        check_fits(120_000_000_000, gib80, 2)


def torchrun_extract(target, data, out, env=None, **kw) -> subprocess.CompletedProcess:
    """`extract --tp 2` under torchrun: two processes on this machine, gloo between them."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "dflash_cache_cli.main",
        *map(str, extract_args(target, data, out)),
        "--tp",
        "2",
    ]
    return subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """A tiny target, its one-process cache, and the same extraction split over two processes."""
    root = tmp_path_factory.mktemp("split")
    target = build_target(root / "target", "qwen3")
    data = write_conversations(root / "data.jsonl", count=8, seed=3)
    extract(ExtractOptions(target=target, data=[data], out=root / "one", layers=LAYERS, token_budget=300))
    run = torchrun_extract(target, data, root / "two")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "process 0 wrote the cache" in run.stdout
    return target, data, root / "one", root / "two"


@pytest.mark.slow  # torchrun's agent and two workers
def test_two_process_tensor_parallel_extraction_equals_one_process(split):
    target, data, one, two = split
    one, two = open_cache(one), open_cache(two)
    assert two.spec == {**one.spec, "tensor_parallel": 2}
    assert sorted(one) == sorted(two) == list(range(8))
    agree = total = 0
    for sid in sorted(one):
        a, b = one[sid], two[sid]
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
        for x, y in zip(a.hidden.float().chunk(2, -1), b.hidden.float().chunk(2, -1)):
            assert (x - y).abs().max() <= TOLERANCE * x.abs().max()
        agree += int((a.target_ids == b.target_ids).sum())
        total += len(a.target_ids)
    assert agree >= 0.95 * total
    # The cache records the split: a run without it is another spec, not a resume; training takes both.
    with pytest.raises(DFlashCacheError, match="tensor_parallel"):
        extract(ExtractOptions(target=target, data=[data], out=two.root, layers=LAYERS, token_budget=300))
    assert spec_differences(one.spec, two.spec, FREE_SPEC_FIELDS) == []


@pytest.mark.slow
def test_a_killed_tensor_parallel_extraction_resumes_to_the_uninterrupted_cache(split, tmp_path):
    """Process 0 killed after its second shard; torchrun ends the other. The same command resumes."""
    target, data, _, two = split
    out = tmp_path / "cache"
    killed = torchrun_extract(target, data, out, env={"DFLASH_CACHE_KILL_AT": "shard.committed:2"})
    assert killed.returncode != 0 and not (out / "manifest.json").exists()
    assert len(list((out / "shards").iterdir())) == 2
    resumed = torchrun_extract(target, data, out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_cache(two, out)
