"""Both stages as two torchrun "nodes" on this machine (one process each, gloo), with the cache in
the local S3 server: the results equal a single-process run."""

import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from dflash_cache.train.distributed import free_port
from dflash_cache.train.train import train
from tests.support.extract import LAYERS, assert_same_cache
from tests.support.train import losses, make_cache, tiny_train_config

pytestmark = pytest.mark.slow  # each node starts torchrun's agent and one worker: a few interpreters


def two_nodes(tmp_path: Path, rendezvous: list[str], args) -> None:
    """Run `dflash-cache ARGS(node)` under two torchrun agents, node 0 and node 1, until both end."""
    procs = []
    for node in range(2):
        log = open(tmp_path / f"node{node}.log", "w")
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            *rendezvous,
            *([] if "--rdzv-backend" in rendezvous else ["--node-rank", str(node)]),
            "-m",
            "dflash_cache_cli.main",
            *map(str, args(node)),
        ]
        procs.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log))
    for node, (proc, log) in enumerate(procs):
        proc.wait(timeout=300)
        log.close()
        assert proc.returncode == 0, (tmp_path / f"node{node}.log").read_text()[-3000:]


def test_extract_on_two_nodes_equals_one_process(reference_extraction, s3_url, tmp_path):
    """Static rendezvous; each node has its own staging folder, as on two machines."""
    target, data, reference = reference_extraction
    two_nodes(
        tmp_path,
        ["--master-addr", "127.0.0.1", "--master-port", str(free_port())],
        lambda node: [
            "extract",
            "--target",
            target,
            "--data",
            data,
            "--out",
            s3_url,
            "--layers",
            ",".join(map(str, LAYERS)),
            "--token-budget",
            300,
            "--shard-size",
            0.02,
            "--staging",
            tmp_path / f"staging{node}",
        ],
    )
    fs, root = fsspec.core.url_to_fs(s3_url)
    assert {p.rsplit("/", 1)[1].split("-")[0] for p in fs.ls(f"{root}/shards")} == {"r0", "r1"}
    assert_same_cache(reference, s3_url)


def test_train_on_two_nodes_equals_one_process(s3_url, tmp_path):
    """c10d rendezvous, DDP over gloo, the cache read from S3; one process with grad accum 2 has the
    same global batch."""
    cache = make_cache(tmp_path / "cache")
    fs, root = fsspec.core.url_to_fs(s3_url)
    fs.put(f"{cache}/", root, recursive=True)
    train(tiny_train_config(tmp_path, cache, out="one", steps=3, grad_accum=2), echo=lambda s: None)
    drafter = tmp_path / "drafter.json"  # written by tiny_train_config
    two_nodes(
        tmp_path,
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "t"],
        lambda node: [
            "train",
            "--cache",
            s3_url,
            "--out",
            tmp_path / "two",
            "--drafter",
            drafter,
            "--steps",
            3,
            "--token-budget",
            128,
            "--max-anchors",
            8,
            "--lr",
            3e-3,
            "--eval-fraction",
            0,
            "--prefetch",
            2,
            "--workers",
            2,
        ],
    )
    assert json.loads((tmp_path / "two" / "run.json").read_text())["world_size"] == 2
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == 3 and two == pytest.approx(one, rel=1e-5)
