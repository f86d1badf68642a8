"""SIGKILL of a real `dflash-cache train` process between checkpoints and while one is written:
`--resume` continues from the last complete checkpoint, never a half-written one, and the losses
equal those of an uninterrupted run."""

import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_cache.train.checkpoint import COMPLETE, latest_checkpoint
from dflash_cache.train.distributed import RankFailed
from dflash_cache.train.train import train
from tests.support.cli import invoke
from tests.support.fulldisk import fill_at
from tests.support.train import (
    drafter_json,
    losses,
    make_cache,
    metrics,
    tiny_train_config,
)

STEPS, SAVE_EVERY = 6, 2


def train_args(cache, drafter, out, *extra):
    return [
        "train",
        "--cache",
        cache,
        "--drafter",
        drafter,
        "--out",
        out,
        "--steps",
        STEPS,
        "--save-every",
        SAVE_EVERY,
        "--token-budget",
        128,
        "--max-anchors",
        8,
        "--eval-fraction",
        0,
        "--workers",
        2,
        *extra,
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_faults")
    cache, drafter = make_cache(root / "cache"), drafter_json(root / "drafter.json")
    result = invoke(*train_args(cache, drafter, root / "whole"))
    assert result.exit_code == 0, result.output
    return cache, drafter, losses(root / "whole")


@pytest.mark.slow
@pytest.mark.parametrize("kill_at, resumed_from", [("train.step:5", 4), ("checkpoint.write:2", 2)])
def test_sigkill_then_resume_equals_uninterrupted(setup, tmp_path, kill_at, resumed_from):
    cache, drafter, whole = setup
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_cache_cli.main", *map(str, train_args(cache, drafter, run))],
        env={**os.environ, "DFLASH_CACHE_KILL_AT": kill_at},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert latest_checkpoint(run).name == f"step-{resumed_from}"
    half_written = run / "checkpoints" / ".step-4.tmp"
    if kill_at.startswith("checkpoint"):  # killed between the training state and complete.json
        assert (half_written / "train_state.safetensors").is_file() and not (half_written / COMPLETE).exists()
    assert len(losses(run)) == (5 if kill_at.startswith("train") else 4)  # steps logged after the checkpoint

    result = invoke(*train_args(cache, drafter, run, "--resume"))
    assert result.exit_code == 0, result.output
    assert f"resuming from {run / 'checkpoints' / f'step-{resumed_from}'}" in result.output
    assert losses(run) == whole  # bit for bit, and metrics.jsonl reads as one run
    assert [r["step"] for r in metrics(run)] == list(range(1, STEPS + 1))
    assert not half_written.exists() and latest_checkpoint(run).name == f"step-{STEPS}"


@pytest.mark.slow
def test_sigkill_of_one_rank_ends_every_rank_promptly(setup, tmp_path):
    """Two CPU ranks (gloo DDP, spawned as for GPUs); one is SIGKILLed mid-run: the run ends within
    30 s with an error naming the rank, and no process is left behind."""
    cache, _, _ = setup
    outcome = []

    def run():
        try:
            train(tiny_train_config(tmp_path, cache, steps=10_000, cpu_procs=2), echo=print)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 240
    while not ((tmp_path / "run" / "metrics.jsonl").is_file() and (tmp_path / "run" / "metrics.jsonl").read_text()):
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.2)
    victim = multiprocessing.active_children()[0]
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive() and time.monotonic() - killed < 30
    assert isinstance(outcome[0], RankFailed) and "died" in str(outcome[0]), outcome
    assert not multiprocessing.active_children()


@pytest.mark.slow
@pytest.mark.usefixtures("small_tmpfs")
def test_full_disk_while_a_checkpoint_is_written_names_the_run_and_resumes_equal(setup, tmp_path):
    """It was a bare `SafetensorError: ... No space left on device` without the run folder or --resume."""
    cache, drafter, whole = setup
    disk = tmp_path / "disk"
    run = disk / "run"
    command = train_args(cache, drafter, run)
    first, then = fill_at("train.step:4", command, [*command, "--resume"], disk, tmp_path)
    error = first.stderr.strip().splitlines()[-1]
    assert first.returncode == 1 and "Traceback" not in first.stderr, first.stderr[-2000:]
    assert error.startswith(
        f"error: writing {run / 'checkpoints' / 'step-4'} failed: No space left on device; "
        f"free space in {run / 'checkpoints'} (0.0 MB free now)"
    ), error
    assert "rerun the same train command with --resume" in error, error
    assert sorted(p.name for p in (tmp_path / "after-first" / "run" / "checkpoints").iterdir()) == ["step-2"]
    assert then.returncode == 0, then.stderr[-2000:]
    assert losses(tmp_path / "after-then" / "run") == whole


def first_moment(checkpoint) -> tuple[str, str]:
    """The name (exp_avg, or Muon's momentum_buffer) and safetensors key of the first parameter's first
    optimizer moment (train_state.json maps the structure to keys)."""

    def entry(node, key):
        return dict(node["dict"])[key]

    structure = json.loads((checkpoint / "train_state.json").read_text())
    name, moment = next(
        (k, v) for k, v in entry(entry(structure, "optimizer"), "state")["dict"][0][1]["dict"] if "tensor" in v
    )
    return name, moment["tensor"]


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda t: t.flatten()[:3].clone(), r"optimizer state {} of \S+ is \[3\], the parameter is \[\d+"),
        (lambda t: torch.full_like(t, float("nan")), r"optimizer state {} of \S+ holds non-finite values"),
    ],
)
def test_a_damaged_optimizer_state_is_named_with_its_checkpoint_before_the_first_step(setup, tmp_path, damage, match):
    """It failed at the first step with a bare RuntimeError on tensor sizes, or (NaN) as a non-finite
    loss that told the user to pass --skip-nonfinite."""
    cache, drafter, _ = setup
    run = tmp_path / "run"
    shutil.copytree(cache.parent / "whole", run)
    for step in (4, 6):
        shutil.rmtree(run / "checkpoints" / f"step-{step}")
    state_file = run / "checkpoints" / "step-2" / "train_state.safetensors"
    tensors = load_file(state_file)
    name, key = first_moment(state_file.parent)
    match = match.format(name)
    tensors[key] = damage(tensors[key])
    save_file(tensors, state_file)
    result = invoke(*train_args(cache, drafter, run, "--resume"))
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert result.stderr.startswith(f"error: {state_file}: ") and re.search(match, result.stderr), result.stderr
    assert "move its folder away" in result.stderr
    assert [r["step"] for r in metrics(run)] in (list(range(1, STEPS + 1)), [1, 2])  # no step was taken
