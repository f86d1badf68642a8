"""Training run folders: one run at a time, options checked before anything is written, checkpoints
that run no code when read, and TensorBoard files that read as one run after --resume."""

import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from dflash_cache.train.checkpoint import CHECKPOINT_DIR
from dflash_cache_cli.main import main
from tests.test_faults_extract import wait_until_stopped
from tests.test_train_helpers import drafter_json, make_cache


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
        6,
        "--save-every",
        2,
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


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout if result.exit_code == 0 else result.stderr


def one_line_error(code, err, *needles):
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A cache, a drafter config and a finished 6-step run saved every 2 steps."""
    root = tmp_path_factory.mktemp("runs")
    cache, drafter = make_cache(root / "cache"), drafter_json(root / "drafter.json")
    code, text = run(*train_args(cache, drafter, root / "whole"))
    assert code == 0, text
    return cache, drafter, root / "whole"


def interrupted_copy(whole, dest, keep_step: int):
    """The finished run as if it had been killed after step 6 with only checkpoint `keep_step` complete."""
    shutil.copytree(whole, dest)
    for path in (dest / CHECKPOINT_DIR).iterdir():
        if path.name != f"step-{keep_step}":
            shutil.rmtree(path)
    return dest


class RunsACommand:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_pickle_in_a_checkpoint_runs_nothing(setup, tmp_path):
    cache, drafter, whole = setup
    out = interrupted_copy(whole, tmp_path / "run", 4)
    step = out / CHECKPOINT_DIR / "step-4"
    marker = tmp_path / "pwned"
    for name in ("train_state.json", "train_state.safetensors"):
        (step / name).unlink(missing_ok=True)
    with open(step / "train_state.pt", "wb") as f:  # what an older dflash-cache (or an attacker) leaves
        pickle.dump({"optimizer": RunsACommand(marker)}, f)
    one_line_error(*run(*train_args(cache, drafter, out, "--resume")), "train_state.json is missing", "not read")
    assert not marker.exists()
    # A JSON state naming anything but the three known forms is refused too.
    (step / "train_state.json").write_text(json.dumps({"dict": [["optimizer", {"__reduce__": "os.system"}]]}))
    (step / "train_state.safetensors").write_bytes(
        (whole / CHECKPOINT_DIR / "step-4" / "train_state.safetensors").read_bytes()
    )
    one_line_error(*run(*train_args(cache, drafter, out, "--resume")), "malformed training state", "__reduce__")
    (step / "train_state.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    one_line_error(*run(*train_args(cache, drafter, out, "--resume")), "unreadable training state")
    assert not marker.exists()


def test_eval_fraction_that_leaves_nothing_writes_no_run(setup, tmp_path):
    cache, drafter, _ = setup
    out = tmp_path / "run"
    args = [a if a != 0 else 0.999 for a in train_args(cache, drafter, out)]
    one_line_error(*run(*args), "no samples left to train on")
    assert not out.exists()
    code, text = run(*train_args(cache, drafter, out))  # the corrected command is not refused
    assert code == 0, text


def tensorboard_steps(run_dir, tag="loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_tensorboard_holds_each_step_once_after_resume(setup, tmp_path):
    cache, drafter, whole = setup
    assert tensorboard_steps(whole) == [1, 2, 3, 4, 5, 6]
    out = interrupted_copy(whole, tmp_path / "run", 2)  # steps 3-6 were logged after the last checkpoint
    code, text = run(*train_args(cache, drafter, out, "--resume"))
    assert code == 0 and "resuming from" in text, text
    assert tensorboard_steps(out) == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_a_second_resume_into_one_run_folder_is_refused(setup, tmp_path):
    cache, drafter, whole = setup
    out = interrupted_copy(whole, tmp_path / "run", 2)
    command = [sys.executable, "-m", "dflash_cache_cli.main", *map(str, train_args(cache, drafter, out, "--resume"))]
    first = subprocess.Popen(
        command,
        env={**os.environ, "DFLASH_CACHE_KILL_AT": "train.step:1:STOP"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until_stopped(first)  # after step 3, holding the run folder
        before = (out / "metrics.jsonl").read_bytes()
        second = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
        one_line_error(second.returncode, second.stderr, f"{out} is being trained by pid {first.pid} on ")
        assert (out / "metrics.jsonl").read_bytes() == before
    finally:
        first.kill()
        first.communicate(timeout=60)
    code, text = run(*train_args(cache, drafter, out, "--resume"))
    assert code == 0, text
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3, 4, 5, 6]


def test_training_state_round_trip(tmp_path):
    import torch

    from dflash_cache.train.state_io import load_state, save_state

    state = {
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}},
            "param_groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "foreach": None, "params": [0]}],
        },
        "rng": [{"python": (3, tuple(range(5)), None), "torch": torch.arange(8, dtype=torch.uint8)}],
        "position": {"step": 4, "epoch": 0},
    }
    save_state(state, tmp_path, "s")
    loaded = load_state(tmp_path, "s")
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert loaded["rng"][0]["python"] == (3, (0, 1, 2, 3, 4), None) and loaded["position"] == state["position"]
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert torch.equal(loaded["rng"][0]["torch"], state["rng"][0]["torch"])


def test_a_train_into_a_run_folder_being_trained_names_the_run_not_resume(tmp_path):
    """A second `train` (without --resume) into a folder another run is training: it said `already holds
    a training run; pass --resume to continue it`, advice the lock then refused. Now the lock's holder
    is named first, with or without --resume, and nothing is written."""
    import json

    from click.testing import CliRunner

    from dflash_cache.files.lock import FolderLock
    from dflash_cache_cli.main import main
    from tests.test_train_helpers import drafter_json, make_cache

    cache, drafter = make_cache(tmp_path / "cache", lengths=[20, 30, 25, 40]), drafter_json(tmp_path / "d.json")
    run = tmp_path / "run"
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    (run / "checkpoints" / "step-1" / "complete.json").write_text(json.dumps({"step": 1}))
    (run / "run.json").write_text("{}")
    holder = FolderLock(run, "run", what="being trained").acquire()  # as the running `train` holds it
    try:
        before = sorted(p for p in run.rglob("*"))
        for extra in ([], ["--resume"]):
            result = CliRunner().invoke(
                main,
                [
                    "train",
                    "--cache",
                    str(cache),
                    "--out",
                    str(run),
                    "--drafter",
                    str(drafter),
                    "--steps",
                    "2",
                    "--token-budget",
                    "128",
                    "--max-anchors",
                    "8",
                    *extra,
                ],
            )
            assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
            assert f"error: {run} is being trained by pid " in result.stderr and "--resume" not in result.stderr
        assert sorted(p for p in run.rglob("*")) == before
    finally:
        holder.release()


def test_a_resumed_runs_event_file_sorts_after_one_written_in_the_same_second(tmp_path):
    pytest.importorskip("tensorboard")
    from dflash_cache.train.metrics import MetricsLog

    tb = tmp_path / "tb"
    tb.mkdir()
    # written this second by a process whose name parts sort last: host "zz", pid 99999, counter 9
    earlier = tb / f"events.out.tfevents.{int(time.time()):010d}.zz.99999.9"
    earlier.write_bytes(b"")
    (tmp_path / "metrics.jsonl").write_text("")
    log = MetricsLog(tmp_path, total_steps=2, resumed_step=1, echo=lambda line: None)
    log.close()
    assert sorted(p.name for p in tb.iterdir())[0] == earlier.name
