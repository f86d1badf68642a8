import json
import math
import shutil
import time

import pytest
import torch

import dflash_cache.train.train as train_module
from dflash_cache import DFlashCacheError
from dflash_cache.stream.caches import CacheSet
from dflash_cache.stream.loader import ReaderError
from dflash_cache.train.checkpoint import COMPLETE, latest_checkpoint
from dflash_cache.train.config import TrainConfig
from dflash_cache.train.train import train
from tests.support.train import drafter_json, losses, make_cache, metrics, tiny_train_config


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("cache") / "c")


def test_eager_run_writes_metrics_checkpoint_and_tensorboard(tmp_path, cache):
    lines = []
    train(tiny_train_config(tmp_path, cache, steps=3, eval_fraction=0.2, eval_every=2), echo=lines.append)
    run = tmp_path / "run"
    records = metrics(run)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert {"step", "loss", "tau", "acc_1", "tokens_per_s", "lr", "grad_norm"} <= set(r)
        assert math.isfinite(r["loss"]) and r["tau"] >= 1 and r["tokens_per_s"] > 0
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 3] and math.isfinite(evals[0]["eval_loss"])
    assert any(line.startswith("Batches per epoch:") for line in lines)
    assert any(line.startswith("step 3/3 | loss") for line in lines)
    assert latest_checkpoint(run) == run / "checkpoints" / "step-3"
    assert list((run / "tb").iterdir())


def test_default_loss_is_dpace_and_a_run_of_dflash_resumes_only_with_it(tmp_path, cache):
    """The first step's loss, on the same batch and weights, is D-PACE's when no loss is named. A run
    trained with dflash records no loss (as the runs from before dpace was the default), and resuming
    it under the default is refused as a different config; with --loss dflash it is accepted."""
    for name, loss in (("default", None), ("dpace", "dpace"), ("dflash", "dflash")):
        train(tiny_train_config(tmp_path, cache, out=name, steps=1, save_every=1, **({"loss": loss} if loss else {})))
    first = {name: losses(tmp_path / name)[0] for name in ("default", "dpace", "dflash")}
    assert first["default"] == first["dpace"] != first["dflash"], first
    assert "loss" not in json.loads((tmp_path / "dflash" / "run.json").read_text())["options"]
    with pytest.raises(DFlashCacheError, match="different config.*loss"):
        train(tiny_train_config(tmp_path, cache, out="dflash", steps=1, resume=True))
    train(tiny_train_config(tmp_path, cache, out="dflash", steps=1, resume=True, loss="dflash"))  # finished: says so


def test_default_optimizer_is_muon_and_a_run_of_adamw_resumes_only_with_it(tmp_path, cache):
    """With no optimizer named, the steps after the first are Muon's (the first loss is the same
    weights on the same batch). A run trained with adamw records no optimizer (as the runs from before
    muon was the default), and resuming it under the default is refused; with --optimizer adamw it is
    accepted."""
    for name, optimizer in (("default", None), ("muon", "muon"), ("adamw", "adamw")):
        options = {"optimizer": optimizer} if optimizer else {}
        train(tiny_train_config(tmp_path, cache, out=name, steps=3, save_every=1, **options))
    default, muon, adamw = (losses(tmp_path / name) for name in ("default", "muon", "adamw"))
    assert default == muon and adamw[0] == muon[0] and adamw[1:] != muon[1:] and all(map(math.isfinite, muon))
    assert json.loads((tmp_path / "default" / "run.json").read_text())["options"]["optimizer"] == "muon"
    assert "optimizer" not in json.loads((tmp_path / "adamw" / "run.json").read_text())["options"]
    with pytest.raises(DFlashCacheError, match="different config.*optimizer"):
        train(tiny_train_config(tmp_path, cache, out="adamw", steps=3, resume=True))
    train(tiny_train_config(tmp_path, cache, out="adamw", steps=3, resume=True, optimizer="adamw"))  # finished


@pytest.mark.parametrize(
    ("options", "lr", "weight_decay"),
    [
        ({}, 1e-3, 0.1),
        ({"optimizer": "muon"}, 1e-3, 0.1),
        ({"optimizer": "adamw"}, 6e-4, 0.01),
        ({"optimizer": "adamw", "lr": 2e-3}, 2e-3, 0.01),
        ({"weight_decay": 0.0}, 1e-3, 0.0),
    ],
)
def test_the_rate_and_weight_decay_default_to_the_optimizers_own(options, lr, weight_decay):
    config = TrainConfig(caches=["c"], out="r", **options)
    assert (config.lr, config.weight_decay) == (lr, weight_decay)


def test_save_every_zero_writes_no_checkpoint(tmp_path, cache):
    train(tiny_train_config(tmp_path, cache, steps=2, save_every=0))
    run = tmp_path / "run"
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2]
    assert latest_checkpoint(run) is None


def test_compiled_mode_matches_eager_with_one_graph(tmp_path, cache):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    train(tiny_train_config(tmp_path, cache, out="eager", steps=3), echo=lambda s: None)
    train(
        tiny_train_config(tmp_path, cache, out="compiled", steps=3, compile=True, compile_backend="aot_eager"),
        echo=lambda s: None,
    )
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-4)
    assert counters["stats"]["unique_graphs"] == 1  # padded shapes: no recompilation across batches


class Crash(Exception):
    pass


def crash_at(monkeypatch, step: int):
    """Make the run die in the middle of `step` (1-based), as a kill would."""
    real = train_module.train_step
    calls = []

    def step_or_crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            raise Crash
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_step", step_or_crash)


def test_resume_equals_an_uninterrupted_run(tmp_path, cache, monkeypatch):
    # 16 samples, budget 128: 6 batches an epoch; 8 steps cross into epoch 1.
    options = {"steps": 8, "save_every": 3, "grad_accum": 1}
    train(tiny_train_config(tmp_path, cache, out="whole", **options), echo=lambda s: None)
    whole = losses(tmp_path / "whole")
    assert len(whole) == 8

    with monkeypatch.context() as m:
        crash_at(m, 8)
        with pytest.raises(Crash):
            train(tiny_train_config(tmp_path, cache, out="cut", **options), echo=lambda s: None)
    run = tmp_path / "cut"
    assert latest_checkpoint(run).name == "step-6"  # saved at the end of epoch 0
    # A checkpoint being written when the run died: never picked up.
    partial = run / "checkpoints" / "step-7"
    shutil.copytree(run / "checkpoints" / "step-6", partial)
    (partial / COMPLETE).unlink()
    (run / "checkpoints" / ".step-7.tmp").mkdir()
    train(tiny_train_config(tmp_path, cache, out="cut", resume=True, **options), echo=lambda s: None)
    assert losses(run) == whole  # bit-exact, and the metrics file reads as one run
    assert [r["step"] for r in metrics(run)] == list(range(1, 9))
    assert not (run / "checkpoints" / ".step-7.tmp").exists()


def test_reader_failure_ends_the_run_promptly(tmp_path, cache, monkeypatch):
    real = CacheSet.read

    def read(self, key):
        if key == 3:
            raise OSError("injected: disk went away")
        return real(self, key)

    monkeypatch.setattr(CacheSet, "read", read)
    start = time.monotonic()
    with pytest.raises(ReaderError, match="sample 3: OSError: injected: disk went away"):
        train(tiny_train_config(tmp_path, cache, epochs=1), echo=lambda s: None)
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("skip", [False, True])
def test_nonfinite_loss_stops_or_is_skipped(tmp_path, cache, monkeypatch, skip):
    from dflash_cache.stream import loader

    real = loader.to_device

    def poisoned(host, *args):
        batch = real(host, *args)
        if 2 in batch.sample_ids:  # sample 2's batch gets NaN hidden states
            batch.hidden.fill_(float("nan"))
        return batch

    monkeypatch.setattr(loader, "to_device", poisoned)
    cfg = tiny_train_config(tmp_path, cache, epochs=1, skip_nonfinite=skip)
    if not skip:
        with pytest.raises(
            DFlashCacheError,
            match=r"non-finite loss at step \d+: a batch of \d+ tokens in \d+ sequences \(sample ids [^)]*\b2\b",
        ):
            train(cfg, echo=lambda s: None)
        return
    train(cfg, echo=lambda s: None)
    records = metrics(tmp_path / "run")
    assert records[-1]["skipped"] == 1
    assert sum(1 for r in records if not math.isfinite(r["loss"])) == 1


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
            "tried to allocate 239095061248 bytes. Error code 12 (Cannot allocate memory)"
        ),
    ],
)
def test_out_of_memory_names_the_batch_and_the_options(tmp_path, cache, monkeypatch, error):
    from dflash_cache.drafter.runner import DrafterRunner

    def oom(self, batch, anchors, **kwargs):
        raise error

    monkeypatch.setattr(DrafterRunner, "__call__", oom)
    with pytest.raises(
        DFlashCacheError,
        match=r"out of memory on cpu at step 1 on a batch of \d+ tokens in \d+ "
        r"sequences .*; lower --token-budget \(now 128\) or --max-anchors \(now 8\)$",
    ):
        train(tiny_train_config(tmp_path, cache, steps=1), echo=lambda s: None)


def test_other_runtime_errors_are_not_called_out_of_memory(tmp_path, cache, monkeypatch):
    from dflash_cache.drafter.runner import DrafterRunner

    def broken(self, batch, anchors, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(DrafterRunner, "__call__", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        train(tiny_train_config(tmp_path, cache, steps=1), echo=lambda s: None)


def test_run_json_records_the_run(tmp_path, cache):
    train(tiny_train_config(tmp_path, cache, steps=1), echo=lambda s: None)
    identity = json.loads((tmp_path / "run" / "run.json").read_text())
    assert identity["options"]["steps"] == 1 and identity["world_size"] == 1
    assert identity["drafter"]["target_layer_ids"] == [1, 3]


def test_under_torchrun_the_process_is_one_rank(tmp_path, cache, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train_module, "launch", None)  # nothing may be spawned
    train(tiny_train_config(tmp_path, cache, steps=2), echo=lambda s: None)
    assert len(losses(tmp_path / "run")) == 2


def test_each_epoch_is_planned_once_before_the_first_step(tmp_path, cache, monkeypatch):
    from dflash_cache.stream.epochs import EpochPlan

    planned, first_step = [], []
    real_batches, real_step = EpochPlan._batches, train_module.train_step

    def batches(self, epoch):
        if not first_step:
            planned.append(epoch)
        return real_batches(self, epoch)

    def step(*args, **kwargs):
        first_step.append(True)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(EpochPlan, "_batches", batches)
    monkeypatch.setattr(train_module, "train_step", step)
    train(tiny_train_config(tmp_path, cache, epochs=3, save_every=0), echo=lambda s: None)
    # prepare counts the steps of epochs 0, 1 and 2; the rank then plans only the epoch it starts with.
    assert planned == [0, 1, 2, 0]


@pytest.mark.gpu
def test_a_gpu_step_waits_for_the_gpu_only_to_read_its_statistics_and_size_the_next_anchors(
    tmp_path, cache, monkeypatch
):
    """Each wait leaves the GPU idle while the host catches up: the optimizer's clipping factor stays on the
    device, and the next batch's anchors are drawn while the GPU is idle anyway."""
    import warnings

    real_step, calls = train_module.train_step, [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:  # the first steps compile; from the third on, steady
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_step", step)
    drafter_json(tmp_path / "drafter.json", head_dim=16)  # flex-attention's GPU kernels take 16 and up
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            train(tiny_train_config(tmp_path, cache, steps=6, cpu_procs=0, gpus=[0], save_every=0), echo=lambda s: None)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    waits = [
        f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)
    ]
    # steps 3-6: each reads its statistics (train.py) and, for steps 3-5, sizes the next batch's anchors
    assert sorted({w.split(":")[0] for w in waits}) == ["anchors.py", "train.py"], waits
    assert len(waits) == 4 + 3, waits
