"""Training checks every shard before the first step (there, of the manifest's size) and each
shard's sha256 once per run, as it first reads it: a shard swapped for another cache's (sound rows,
the same sample ids, the same size) stops the run naming it."""

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_cache.store.reader import ShardReader
from dflash_cache_cli.main import main
from tests.test_train_helpers import drafter_json, make_cache, tiny_config

LENGTHS = [40, 23, 57, 31, 12, 64, 45, 19]  # four rows a shard: two shards


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    # Raw bf16: a shard's size follows from its rows' lengths, so the two caches' shards are equal in size.
    a = make_cache(root / "a", LENGTHS, codec="bf16", seed=0)
    b = make_cache(root / "b", LENGTHS, codec="bf16", seed=1)
    assert (a / "shards/r0-00001.arrow").stat().st_size == (b / "shards/r0-00001.arrow").stat().st_size
    return a, b, drafter_json(root / "drafter.json")


def train(cache, drafter, out):
    args = [
        "train",
        "--cache",
        cache,
        "--out",
        out,
        "--drafter",
        drafter,
        "--steps",
        4,
        "--token-budget",
        128,
        "--max-anchors",
        8,
        "--eval-fraction",
        0,
        "--workers",
        2,
    ]
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stderr


def one_line_error(code, err, *needles):
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def test_a_swapped_shard_stops_training_naming_it(caches, tmp_path):
    a, b, drafter = caches
    swapped = shutil.copytree(a, tmp_path / "swapped")
    shutil.copyfile(b / "shards/r0-00001.arrow", swapped / "shards/r0-00001.arrow")
    one_line_error(
        *train(swapped, drafter, tmp_path / "run"), f"{swapped}/shards/r0-00001.arrow: sha256 does not match"
    )


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_missing_or_cut_shard_is_found_before_the_run_folder_is_written(caches, tmp_path, damage):
    a, _, drafter = caches
    broken = shutil.copytree(a, tmp_path / "broken")
    shard = broken / "shards/r0-00001.arrow"
    if damage == "delete":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:-100])
    message = "shard listed in the manifest is missing" if damage == "delete" else "(truncated or replaced)"
    one_line_error(*train(broken, drafter, tmp_path / "run"), f"{shard}: ", message)
    assert not (tmp_path / "run").exists()


def test_each_shard_is_hashed_once_per_run(caches, tmp_path, monkeypatch):
    """Three epochs read every shard three times; each is hashed once."""
    from dflash_cache.train.train import train as run_training

    a, _, _ = caches
    hashed = []
    real = ShardReader.sha256
    monkeypatch.setattr(ShardReader, "sha256", lambda self: hashed.append(Path(self.path).name) or real(self))
    run_training(tiny_config(tmp_path, a, epochs=3), echo=lambda line: None)
    assert sorted(hashed) == ["r0-00000.arrow", "r0-00001.arrow"]
