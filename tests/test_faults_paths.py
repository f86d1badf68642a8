"""Hostile caches: paths in a manifest (with a valid checksum), a journal or a remote listing that
point out of the cache are refused before anything is opened, fetched, written or deleted."""

import json
import os
import shutil

import fsspec
import pytest
from click.testing import CliRunner

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.store.manifest import manifest_checksum, read_journals
from dflash_cache.store.remote import RemoteDir
from dflash_cache.store.verify import verify_cache
from dflash_cache_cli.main import main
from tests.cachegen import random_spec, write_random_cache
from tests.s3server import s3_server, s3_url  # noqa: F401 - fixtures

HOSTILE = [
    "../outside.arrow",
    "/etc/passwd",
    "shards/../../outside.arrow",
    "shards/sub/r0-00000.arrow",
    "shards/.hidden.arrow",
    "shards/r0-00000.arrow/..",
]


@pytest.fixture
def cache(tmp_path):
    """A random cache of three shards under tmp_path/box, and a file beside the cache it must never read."""
    root = tmp_path / "box" / "cache"
    write_random_cache(root, [30, 20, 25, 40, 35, 28], random_spec(), rows_per_shard=2)
    (tmp_path / "box" / "outside.arrow").write_bytes((root / "shards" / "r0-00000.arrow").read_bytes())
    return root


def with_shard_path(root, path: str, index: int = 0) -> None:
    """Point the manifest's shard `index` at `path` and recompute its checksum (a deliberate edit)."""
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["shards"][index]["path"] = path
    manifest["checksum"] = manifest_checksum(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stderr


@pytest.mark.parametrize("path", HOSTILE)
def test_a_manifest_path_out_of_the_cache_is_refused(cache, path):
    with_shard_path(cache, path)
    with pytest.raises(DFlashCacheError, match=r"malformed manifest \(shard path .* is not shards/NAME.arrow\)"):
        open_cache(cache)
    code, err = cli("verify", cache)
    assert code == 1 and err.count("\n") == 1 and "is not shards/NAME.arrow" in err, err
    assert "bytes" not in err  # nothing about the outside file leaks


def test_a_journal_path_out_of_the_cache_is_refused(cache):
    journal = cache / "journal" / "r0.jsonl"
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    next(e for e in lines if "shard" in e)["shard"]["path"] = "../outside.arrow"
    journal.write_text("".join(json.dumps(e) + "\n" for e in lines))
    with pytest.raises(DFlashCacheError, match=r"r0.jsonl: corrupt entry \(shard path '../outside.arrow' is not"):
        read_journals(cache)


def test_a_shard_symlinked_out_of_the_cache_is_refused(cache):
    """The link leads to a byte-identical copy outside: its sha256 matches, and still it is not read."""
    shard = cache / "shards" / "r0-00000.arrow"
    shard.unlink()
    shard.symlink_to(cache.parent / "outside.arrow")
    opened = open_cache(cache)
    with pytest.raises(DFlashCacheError, match=r"r0-00000.arrow leads out of the cache"):
        opened[0]
    with pytest.raises(DFlashCacheError, match=r"r0-00000.arrow leads out of the cache"):
        verify_cache(opened)
    (cache / "shards").rename(cache.parent / "elsewhere")  # the whole folder linked elsewhere
    (cache / "shards").symlink_to(cache.parent / "elsewhere")
    with pytest.raises(DFlashCacheError, match="leads out of the cache"):
        open_cache(cache)[3]


def test_a_target_file_symlinked_out_of_the_cache_is_refused(tmp_path):
    from dflash_cache.store.integrity import check_target_files

    (tmp_path / "target").mkdir()
    (tmp_path / "secret").write_text("x")
    (tmp_path / "target" / "config.json").symlink_to(tmp_path / "secret")
    with pytest.raises(DFlashCacheError, match="config.json leads out of the cache"):
        check_target_files(tmp_path / "target", {"target_files": {"config.json": "0" * 64}})


def test_a_remote_manifest_path_never_reaches_the_local_folder(cache, s3_url, tmp_path):
    """An object stored under the hostile key itself: the fetcher would write it outside its folder."""
    with_shard_path(cache, "shards/../../../escaped.arrow")
    fs, root = fsspec.core.url_to_fs(s3_url)
    fs.put(str(cache) + "/", root, recursive=True)
    fs.pipe_file(f"{root}/shards/../../../escaped.arrow", b"attacker's bytes")
    folder = tmp_path / "fetch" / "here"
    folder.mkdir(parents=True)
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(DFlashCacheError, match="is not shards/NAME.arrow"):
        open_cache(s3_url, folder, 10 << 20)
    assert not any(p.name == "escaped.arrow" for p in tmp_path.rglob("*"))
    assert sorted(p for p in tmp_path.rglob("*") if "fetch" not in p.parts) == [
        p for p in before if "fetch" not in p.parts
    ]


def test_a_hostile_remote_listing_of_target_is_refused(cache, s3_url, tmp_path, monkeypatch):
    fs, root = fsspec.core.url_to_fs(s3_url)
    fs.put(str(cache) + "/", root, recursive=True)
    remote = open_cache(s3_url)
    listing = RemoteDir.list
    monkeypatch.setattr(RemoteDir, "list", lambda self, rel: [".."] if rel == "target" else listing(self, rel))
    with pytest.raises(DFlashCacheError, match=r"target: '\.\.' is not a plain file name"):
        remote.target_dir()


def test_the_fetcher_checks_what_it_writes_and_evicts(cache, s3_url, tmp_path):
    """Even handed a record that skipped the manifest's checks, the fetcher writes and deletes only
    inside its folder."""
    from dflash_cache.store.fetch import ShardFetcher
    from dflash_cache.store.shard import ShardRecord

    fs, root = fsspec.core.url_to_fs(s3_url)
    fs.put(str(cache) + "/", root, recursive=True)
    fetcher = ShardFetcher(RemoteDir(s3_url), tmp_path / "fetch", 10 << 20)
    victim = tmp_path / "victim.arrow"
    victim.write_bytes(b"keep me")
    depth = len(fetcher.root.relative_to(tmp_path).parts)
    record = ShardRecord(
        path="shards/" + "../" * (depth + 1) + "victim.arrow",
        rows=0,
        tokens=0,
        bytes=7,
        hidden_bytes=0,
        sha256="0" * 64,
    )
    with pytest.raises(DFlashCacheError, match="is not shards/NAME.arrow"):
        fetcher.open(record)
    assert victim.read_bytes() == b"keep me"
    assert os.listdir(fetcher.root / "shards") == []
    shutil.rmtree(tmp_path / "fetch")


# ---- folders handed over and written into: a cache to finish, a run to resume, an export to replace ----


def linked_out(folder, name, tmp_path):
    """Replace `folder/name` with a symlink to a file of someone's own outside the folder; returns it."""
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    link = folder / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(victim)
    return victim


@pytest.mark.parametrize(
    "name", ["locks/cache.lock", "journal/r0.jsonl", "shards/r0-00009.arrow.tmp", "manifest.json.tmp"]
)
def test_extract_into_a_cache_with_a_link_out_writes_nothing_through_it(cache, tmp_path, name):
    """Refused before the lock is taken. The lock file linked out was overwritten with `pid P on HOST`
    before the run found that this cache's settings differ; on a real resume a journal linked out was
    appended to (tried by hand: 19 lines added to the outside file)."""
    from tests.tiny import build_target, write_conversations

    victim = linked_out(cache, name, tmp_path)
    target, data = build_target(tmp_path / "target", "qwen3"), write_conversations(tmp_path / "data.jsonl", count=2)
    code, err = cli("extract", "--target", target, "--data", data, "--out", cache, "--layers", "1,3")
    assert victim.read_text() == "keep me\n"
    assert code == 1 and err.count("\n") == 1, err
    assert f"{cache / name} is a symbolic link out of the folder (to {victim}); refusing to write through it" in err


def test_a_link_that_stays_inside_the_folder_is_not_refused(tmp_path):
    from dflash_cache.files.folders import check_no_links_out

    (tmp_path / "out" / "a").mkdir(parents=True)
    (tmp_path / "out" / "b").symlink_to("a")
    check_no_links_out(tmp_path / "out", "--out")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out" / "a" / "c").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DFlashCacheError, match="a/c is a symbolic link out of the folder"):
        check_no_links_out(tmp_path / "out", "--out")


@pytest.mark.parametrize("name", ["locks/run.lock", "metrics.jsonl"])
def test_train_resume_of_a_run_with_a_link_out_writes_nothing_through_it(tmp_path, name):
    from tests.test_train_helpers import drafter_json, make_cache

    cache, drafter = make_cache(tmp_path / "cache", lengths=[20, 30, 25, 40]), drafter_json(tmp_path / "d.json")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    victim = linked_out(run, name, tmp_path)
    code, err = cli(
        "train",
        "--cache",
        cache,
        "--out",
        run,
        "--drafter",
        drafter,
        "--steps",
        2,
        "--token-budget",
        128,
        "--max-anchors",
        8,
        "--resume",
    )
    assert victim.read_text() == "keep me\n"
    assert code == 1 and err.count("\n") == 1 and f"{run / name} is a symbolic link out of the folder" in err, err


def test_export_into_a_folder_with_a_link_out_is_refused_as_the_others_are(tmp_path):
    """Before, export replaced the link (nothing was written through it); now the rule for every
    output folder refuses it too."""
    from dflash_cache.drafter.checkpoint import save_drafter
    from dflash_cache.drafter.config import DrafterConfig
    from dflash_cache.drafter.model import DFlashDrafter

    save_drafter(
        DFlashDrafter(
            DrafterConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                vocab_size=100,
                block_size=4,
                target_layer_ids=[1, 3],
                mask_token_id=99,
            )
        ),
        tmp_path / "checkpoint",
    )
    victim = linked_out(tmp_path / "export", "model.safetensors", tmp_path)
    code, err = cli("export", tmp_path / "checkpoint", "--out", tmp_path / "export")
    assert victim.read_text() == "keep me\n"
    assert code == 1 and err.count("\n") == 1 and "model.safetensors is a symbolic link out of the folder" in err, err
