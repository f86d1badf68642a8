"""`train --follow` beside a real, slowed extraction: training starts before the extraction ends,
trains on every sample once in the first epoch, resumes after SIGKILL with the same losses, and
waits (saying so) for a killed extraction until it is run again."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from dflash_cache import open_cache
from dflash_cache.store.verify import verify_cache
from dflash_cache_cli.main import main
from tests.support.cli import invoke, spawn
from tests.support.extract import extract_args
from tests.support.tiny import build_target, write_conversations
from tests.support.train import drafter_json, losses, metrics

SLOW = {"DFLASH_CACHE_DELAY_AT": "shard.committed:1.0"}  # an extraction committing a shard every second or more
STEPS = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("follow")
    target = build_target(root / "target", "qwen3")
    data = write_conversations(root / "data.jsonl", count=24, seed=3)
    drafter = drafter_json(root / "d.json", hidden_size=64, vocab_size=384, mask_token_id=383, target_layer_ids=[1, 4])
    return target, data, drafter


def train_args(cache, drafter, out, *extra, grad_accum=2):
    return [
        "train",
        "--follow",
        "--cache",
        cache,
        "--drafter",
        drafter,
        "--out",
        out,
        "--steps",
        STEPS,
        "--save-every",
        3,
        "--token-budget",
        512,
        "--grad-accum",
        grad_accum,
        "--max-anchors",
        4,
        "--eval-fraction",
        0,
        "--workers",
        2,
        *extra,
    ]


class Lines:
    """A process's stdout, read line by line on a thread."""

    def __init__(self, proc):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True)
        self.thread.start()

    def wait_for(self, text: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline, f"never printed {text!r}:\n" + "".join(self.lines[-20:])
            time.sleep(0.2)


def first_epoch_tokens(run) -> int:
    return sum(r["tokens"] for r in metrics(run) if "loss" in r and r["epoch"] == 0)


def follow(setup, tmp_path, train_env=None, launcher=(), grad_accum=2, during=None):
    """An extraction (slowed) and a following training run started at once; returns (cache, run,
    the training process, whether a step was logged while the extraction was still running).
    `during(cache)` is called once then."""
    target, data, drafter = setup
    cache, run = tmp_path / "cache", tmp_path / "run"
    extraction = spawn(*extract_args(target, data, cache), env=SLOW)
    training = subprocess.Popen(
        [
            sys.executable,
            "-m",
            *launcher,
            "dflash_cache_cli.main",
            *map(str, train_args(cache, drafter, run, grad_accum=grad_accum)),
        ],
        env={**os.environ, **(train_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    early = False
    while extraction.poll() is None:
        if not early and (run / "metrics.jsonl").is_file() and losses(run):
            early = True
            if during is not None:
                during(cache, extraction)
        time.sleep(0.2)
    assert extraction.returncode == 0, extraction.communicate()[1][-2000:]
    _, training.err = training.communicate(timeout=300)
    return cache, run, training, early


@pytest.mark.slow
def test_following_trains_before_the_end_and_every_sample_once(setup, tmp_path):
    refused = []

    def other_readers_refuse(cache, extraction):
        running = (
            f"is being written by pid {extraction.pid} on {socket.gethostname()} (an extraction that has not finished)"
        )
        for args in (["inspect", cache], ["verify", cache]):
            result = invoke(*args)
            refused.append(result.exit_code == 1 and running in result.stderr)

    cache, run, training, early = follow(setup, tmp_path, during=other_readers_refuse)
    assert training.returncode == 0, training.err[-2000:]
    assert early  # a step was logged before the extraction ended
    assert refused == [True, True]  # meanwhile readers without --follow refused the cache
    finished = open_cache(cache)
    assert len(finished.shards) >= 4
    consumed = [json.loads(line)["shard"] for line in (run / "follow.jsonl").read_text().splitlines()]
    assert sorted(consumed) == sorted(s.path for s in finished.shards) and len(set(consumed)) == len(consumed)
    # Every sample's tokens once in epoch 0 (eval fraction 0, one rank): the manifest's total.
    assert first_epoch_tokens(run) == finished.manifest["totals"]["tokens"]
    assert [r["epoch"] for r in metrics(run) if "loss" in r][-1] >= 1  # and on into the ordinary second epoch
    assert verify_cache(finished).rows == finished.manifest["totals"]["samples"] == 24


@pytest.fixture(scope="module")
def uninterrupted(setup, tmp_path_factory):
    _, whole, training, _ = follow(setup, tmp_path_factory.mktemp("whole"))
    assert training.returncode == 0, training.err[-2000:]
    return whole


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["train.step:5", "train.step:14"])  # in the followed first epoch, in the second
def test_sigkill_of_the_following_run_then_resume_gives_the_same_losses(setup, uninterrupted, tmp_path, kill_at):
    whole = uninterrupted
    assert [r["epoch"] for r in metrics(whole) if "loss" in r][13] == 1
    cache, run, killed, _ = follow(setup, tmp_path / "killed", train_env={"DFLASH_CACHE_KILL_AT": kill_at})
    assert killed.returncode == -signal.SIGKILL
    drafter = setup[2]
    result = invoke(*train_args(cache, drafter, run, "--resume"))
    assert result.exit_code == 0, result.output
    assert losses(run) == losses(whole) and len(losses(whole)) == STEPS
    assert (run / "follow.jsonl").read_text() == (whole / "follow.jsonl").read_text()


@pytest.mark.slow
def test_a_killed_extraction_leaves_training_waiting_until_it_is_run_again(setup, tmp_path):
    target, data, drafter = setup
    cache, run = tmp_path / "cache", tmp_path / "run"
    training = spawn(*train_args(cache, drafter, run))  # started first: the folder is not there yet
    out = Lines(training)
    out.wait_for("waiting for the extraction to write the target head and journals")
    assert not cache.exists()
    first = spawn(*extract_args(target, data, cache), env={**SLOW, "DFLASH_CACHE_KILL_AT": "shard.committed:2"})
    first.communicate(timeout=300)
    assert first.returncode == -signal.SIGKILL
    out.wait_for("no extraction is running on it (killed or failed?): rerun the same extract command")
    assert training.poll() is None  # waiting, not failed

    timed = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_cache_cli.main",
            *map(str, train_args(cache, drafter, tmp_path / "other", "--follow-timeout", 2)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert timed.returncode == 1 and timed.stderr.count("\n") == 1, timed.stderr
    assert f"--follow: nothing new in {cache} for 2 s" in timed.stderr and "no extraction is running" in timed.stderr

    second = spawn(*extract_args(target, data, cache))
    assert second.wait(timeout=300) == 0, second.communicate()[1][-2000:]
    assert training.wait(timeout=300) == 0, training.communicate()[1][-2000:]
    out.thread.join(timeout=30)
    finished = open_cache(cache)
    assert first_epoch_tokens(run) == finished.manifest["totals"]["tokens"]
    assert verify_cache(finished).rows == 24


@pytest.mark.slow
def test_two_torchrun_ranks_follow_as_one_process_with_the_same_global_batch(setup, uninterrupted, tmp_path):
    one = uninterrupted  # one process, grad_accum 2: the same global batch as two ranks of 1
    launcher = ("torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m")
    cache, two, ranks, early = follow(setup, tmp_path / "two", launcher=launcher, grad_accum=1)
    assert ranks.returncode == 0, ranks.err[-3000:]
    assert early and json.loads((two / "run.json").read_text())["world_size"] == 2
    assert (two / "follow.jsonl").read_text() == (one / "follow.jsonl").read_text()
    assert losses(two) == pytest.approx(losses(one), rel=1e-5) and len(losses(one)) == STEPS
    assert first_epoch_tokens(two) == first_epoch_tokens(one) == open_cache(cache).manifest["totals"]["tokens"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--follow"], "--follow needs --steps"),
        (["--follow", "--steps", 2, "--compile"], "--follow trains eagerly"),
        (["--steps", 2, "--follow-timeout", 5], "--follow-timeout applies only with --follow"),
        (["--follow", "--steps", 2, "--follow-timeout", 0], "--follow-timeout must be positive"),
    ],
)
def test_follow_options_are_checked_first(tmp_path, extra, message):
    result = CliRunner().invoke(
        main, [str(a) for a in ["train", "--cache", tmp_path / "cache", "--out", tmp_path / "run", *extra]]
    )
    assert result.exit_code == 1 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "run").exists()
