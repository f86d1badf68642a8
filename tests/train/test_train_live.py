"""`train --live-target`: the target beside the drafter trains to the losses `train --cache` gets from a
bf16-zstd cache extracted one sample per forward from the same data; bad combinations fail in one line."""

import math

import pytest

from dflash_cache.extract.pipeline import ExtractOptions, extract
from dflash_cache.train.train import train
from tests.support.cli import cli, one_line_error
from tests.support.train import drafter_json, losses, metrics, tiny_train_config

LAYERS = [1, 4]
TIMING = {"tokens_per_s", "step_time_s"}


@pytest.fixture(scope="module")
def setup(qwen3_target_dir, conversations, tmp_path_factory):
    root = tmp_path_factory.mktemp("train-live")
    cache = root / "cache"
    extract(
        ExtractOptions(
            target=qwen3_target_dir, data=[conversations], out=cache, layers=LAYERS, token_budget=1, batching="padded"
        )
    )
    drafter = drafter_json(root / "drafter.json", hidden_size=64, head_dim=16, target_layer_ids=LAYERS)
    return cache, drafter, qwen3_target_dir, conversations


def options(drafter, out, *extra):
    return [
        "train",
        "--out",
        out,
        "--drafter",
        drafter,
        "--steps",
        4,
        "--token-budget",
        200,
        "--max-anchors",
        8,
        "--eval-fraction",
        0.25,
        "--eval-every",
        2,
        "--lr",
        3e-3,
        "--workers",
        2,
        *extra,
    ]


def live(target, data, *extra):
    return ["--live-target", target, "--data", data, "--layers", ",".join(map(str, LAYERS)), *extra]


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_live_target_trains_to_the_losses_of_the_cache(tmp_path, setup):
    cache, drafter, target, data = setup
    code, text = cli(*options(drafter, tmp_path / "cached", "--cache", cache))
    assert code == 0, text
    code, text = cli(*options(drafter, tmp_path / "live", *live(target, data, "--exact-target")))
    assert code == 0, text
    assert "computed live by" in text and "one sample per target forward" in text and "step 4/4 | loss" in text
    cached, streamed = metrics(tmp_path / "cached"), metrics(tmp_path / "live")
    assert len(losses(tmp_path / "live")) == 4 and len({r["loss"] for r in cached if "loss" in r}) > 1
    assert [r["step"] for r in streamed if "eval_loss" in r] == [2, 4]  # held-out batches computed live too
    assert without_timing(streamed) == without_timing(cached)  # every loss, tau, gradient norm, bit for bit


def test_packed_forwards_by_default_and_resume_keeps_the_mode(tmp_path, setup):
    _, drafter, target, data = setup
    code, text = cli(*options(drafter, tmp_path / "exact", *live(target, data, "--exact-target")))
    assert code == 0, text
    out = tmp_path / "packed"
    code, text = cli(*options(drafter, out, *live(target, data)))
    assert code == 0, text
    assert "target forwards of <= 200 padded tokens" in text
    packed, exact = losses(out), losses(tmp_path / "exact")
    assert all(math.isfinite(x) for x in packed)
    assert packed == pytest.approx(exact, rel=0.05)  # bf16 rounding of other batch shapes only
    one_line_error(
        *cli(*options(drafter, out, *live(target, data, "--exact-target"), "--resume")),
        "different config",
        "forward_tokens",
    )


@pytest.mark.parametrize(
    "extra, needle",
    [
        ([], "give --cache CACHE, or --live-target MODEL_DIR with --data FILE"),
        (["--cache", "CACHE", "--live-target", "TARGET", "--data", "DATA"], "give --cache or --live-target, not both"),
        (["--live-target", "TARGET"], "--live-target needs --data FILE"),
        (["--cache", "CACHE", "--data", "DATA"], "--data applies only with --live-target"),
        (["--cache", "CACHE", "--target-gpus", "0"], "--target-gpus applies only with --live-target"),
        (["--cache", "CACHE", "--exact-target"], "--exact-target applies only with --live-target"),
        (
            ["--live-target", "TARGET", "--data", "DATA", "--local-cache", "x"],
            "--local-cache applies only with --cache",
        ),
        (
            ["--live-target", "TARGET", "--data", "DATA", "--num-draft-layers", 2, "--layers", "1,4"],
            "give either --layers or --num-draft-layers",
        ),
        (["--live-target", "TARGET", "--data", "DATA", "--layers", "1,9"], "layer index 9 is out of range"),
        (["--live-target", "TARGET", "--data", "DATA", "--target-gpus", "0-63"], "--target-gpus names 64 GPU(s) for"),
        (["--live-target", "TARGET", "--data", "DATA", "--target-gpus", "99"], "--target-gpus names"),
        (["--live-target", "nowhere", "--data", "DATA"], "target nowhere does not exist"),
    ],
)
def test_bad_combinations(tmp_path, setup, extra, needle):
    cache, drafter, target, data = setup
    names = {"CACHE": cache, "TARGET": target, "DATA": data}
    one_line_error(*cli(*options(drafter, tmp_path / "run", *[names.get(x, x) for x in extra])), needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_ranks_each_with_its_own_target(tmp_path, setup):
    """Two CPU ranks, each running its own copy of the target: the losses of one rank with the same global batch."""
    _, _, target, data = setup
    source = {
        "caches": [],
        "live_target": str(target),
        "data": [str(data)],
        "layers": LAYERS,
        "exact_target": True,
        "token_budget": 200,
    }
    drafter = drafter_json(tmp_path / "drafter.json", hidden_size=64, head_dim=16, target_layer_ids=LAYERS)
    train(tiny_train_config(tmp_path, "", out="one", steps=2, grad_accum=2, drafter=str(drafter), **source), echo=print)
    train(tiny_train_config(tmp_path, "", out="two", steps=2, cpu_procs=2, drafter=str(drafter), **source), echo=print)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == 2 and two == pytest.approx(one, rel=1e-5)
