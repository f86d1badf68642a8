"""Damaged and hand-edited caches. Every file of a real cache, with a bit flipped or cut short, is
reported by `verify` and refused by `train` as one line naming the file, with nothing written; the
advice in the message works."""

import json
import random
import shutil

import pytest

from dflash_cache import open_cache
from dflash_cache.store.manifest import manifest_checksum
from tests.support.cli import cli, one_line_error
from tests.support.extract import run_extract
from tests.support.tiny import build_target, write_conversations
from tests.support.train import drafter_json

FILES = [
    "manifest.json",
    "journal/r0.jsonl",
    "shards/r0-00002.arrow",
    "target/head.safetensors",
    "target/config.json",
    "target/tokenizer.json",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    target = build_target(root / "target", "qwen3")
    data = write_conversations(root / "data.jsonl", count=8, seed=7)
    run_extract(target, data, root / "cache", max_shard_bytes=20 << 10)
    drafter = drafter_json(
        root / "drafter.json", hidden_size=64, vocab_size=384, target_layer_ids=[1, 4], mask_token_id=3
    )
    return target, data, root / "cache", drafter


def damage(source, dest, name, how, seed=0):
    """A copy of the cache with one file damaged: 'truncate' (half), 'empty' or 'flip' (one bit, chosen by `seed`)."""
    shutil.copytree(source, dest)
    path = dest / name
    data = bytearray(path.read_bytes())
    if how == "flip":
        rng = random.Random(f"{name} {seed}")
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    else:
        data = data[: len(data) // 2] if how == "truncate" else bytearray()
    path.write_bytes(bytes(data))
    return dest


def train_args(cache, drafter, out):
    return [
        "train",
        "--cache",
        cache,
        "--drafter",
        drafter,
        "--out",
        out,
        "--epochs",
        1,
        "--token-budget",
        512,
        "--max-anchors",
        4,
        "--eval-fraction",
        0,
        "--workers",
        1,
    ]


@pytest.mark.parametrize("name", FILES)
def test_verify_reports_any_flip_or_truncation_of_any_file(setup, tmp_path, name):
    cache = setup[2]
    assert cli("verify", cache)[0] == 0
    for i, how in enumerate(["truncate", "empty"] + ["flip"] * 8):
        code, err = cli("verify", damage(cache, tmp_path / str(i), name, how, seed=i))
        one_line_error(code, err, name.split("/")[0] if name.startswith("journal") else name)


@pytest.mark.parametrize(
    "name, how",
    [
        ("manifest.json", "flip"),
        ("manifest.json", "truncate"),
        ("target/head.safetensors", "flip"),
        ("target/head.safetensors", "truncate"),
        ("target/config.json", "flip"),
        ("target/tokenizer.json", "empty"),
    ],
)
def test_train_refuses_a_damaged_manifest_or_target_file_before_starting(setup, tmp_path, name, how):
    _, _, cache, drafter = setup
    code, err = cli(*train_args(damage(cache, tmp_path / "cache", name, how), drafter, tmp_path / "run"))
    one_line_error(code, err, name)
    assert not (tmp_path / "run").exists()


def test_train_stops_on_a_damaged_shard_naming_it(setup, tmp_path):
    _, _, cache, drafter = setup
    code, err = cli(
        *train_args(damage(cache, tmp_path / "cut", "shards/r0-00002.arrow", "truncate"), drafter, tmp_path / "a")
    )
    one_line_error(code, err, "r0-00002.arrow")
    damaged = shutil.copytree(cache, tmp_path / "flipped")
    shard = damaged / "shards" / "r0-00002.arrow"
    data = bytearray(shard.read_bytes())
    reader = open_cache(cache)
    payload = bytes(reader.read_stored(reader.shards[2].sample_ids[0]).hidden)
    data[bytes(data).index(payload[:64]) + 40] ^= 0x40  # inside the row's hidden payload
    shard.write_bytes(bytes(data))
    code, err = cli(*train_args(damaged, drafter, tmp_path / "b"))
    one_line_error(code, err, "r0-00002.arrow", "sha256 does not match")  # the shard's hash, before any row's checksum


@pytest.mark.parametrize(
    "name, message",
    [
        ("manifest.json", "the cache is incomplete"),
        ("shards/r0-00002.arrow", "shard listed in the manifest is missing"),
        ("target/head.safetensors", "is missing"),
        ("target/config.json", "is missing"),
    ],
)
def test_a_deleted_file(setup, tmp_path, name, message):
    _, _, cache, drafter = setup
    damaged = shutil.copytree(cache, tmp_path / "cache")
    (damaged / name).unlink()
    one_line_error(*cli("verify", damaged), name, message)
    one_line_error(*cli(*train_args(damaged, drafter, tmp_path / "run")), name, message)


def test_train_needs_only_the_manifest_not_the_journals(setup, tmp_path):
    _, _, cache, drafter = setup
    damaged = damage(cache, tmp_path / "cache", "journal/r0.jsonl", "truncate")
    code, err = cli(*train_args(damaged, drafter, tmp_path / "run"))
    assert code == 0, err


def edit_manifest(source, dest, change, checksum: bool):
    shutil.copytree(source, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    change(manifest)
    if checksum:  # a deliberate edit that even recomputes the manifest's own checksum
        manifest["checksum"] = manifest_checksum(manifest)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def test_hand_edited_manifest(setup, tmp_path):
    _, _, cache, drafter = setup
    edits = {
        "sha": (lambda m: m["shards"][1].update(sha256="0" * 64), "r0-00001.arrow: sha256 does not match"),
        "dropped shard": (
            lambda m: m["shards"].pop(3),
            "shards/r0-00003.arrow: in the journals but not in the manifest",
        ),
        "layer": (lambda m: m["spec"].update(layer_ids=[1, 3]), "layer_ids: [1, 4] -> [1, 3]"),
        "rows": (lambda m: m["shards"][0].update(rows=m["shards"][0]["rows"] + 1), "lists inconsistent rows"),
    }
    for what, (change, message) in edits.items():
        edited = edit_manifest(cache, tmp_path / what, change, checksum=False)
        refused = message if what == "rows" else "manifest.json: checksum does not match its content"
        for command in (["verify", edited], ["inspect", edited], train_args(edited, drafter, tmp_path / "run")):
            one_line_error(*cli(*command), refused)
        one_line_error(*cli("verify", edit_manifest(cache, tmp_path / f"{what} 2", change, checksum=True)), message)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "name, advice",
    [
        ("target/head.safetensors", "delete {root}/target and rerun the same extract command"),
        ("manifest.json", "rerun the same extract command to rebuild it from the journals"),
    ],
)
def test_the_advice_in_the_message_works(setup, tmp_path, name, advice):
    target, data, cache, _ = setup
    damaged = damage(cache, tmp_path / "cache", name, "flip")
    one_line_error(*cli("verify", damaged), advice.format(root=damaged))
    if name.startswith("target"):
        shutil.rmtree(damaged / "target")
    run_extract(target, data, damaged, max_shard_bytes=20 << 10)
    assert cli("verify", damaged)[0] == 0
    assert (damaged / name).read_bytes() == (cache / name).read_bytes()
