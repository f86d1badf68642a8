"""Caches in object storage, against a real S3-compatible server on localhost (tests/support/s3server.py):
extract -> verify -> inspect -> train, resume after a killed upload, byte-range reads, and the
bounded local folder of whole shards."""

import json
import signal

import fsspec
import pytest
import torch
from click.testing import CliRunner

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.store.remote import RemoteDir
from dflash_cache.store.verify import verify_cache
from dflash_cache.train.train import train
from dflash_cache_cli.main import main
from tests.support.cachegen import random_spec, write_random_cache
from tests.support.cli import spawn
from tests.support.extract import (
    LAYERS,
    SHARD_BYTES,
    assert_same_cache,
    extract_args,
    run_extract,
)
from tests.support.s3server import SECRET
from tests.support.tiny import build_tokenizer
from tests.support.train import drafter_json, losses, tiny_train_config


@pytest.fixture(scope="module")
def s3_cache(reference_extraction, s3_server, tmp_path_factory):
    """The same extraction to S3: (url, staging folder, the relative path of every upload in order)."""
    target, data, _ = reference_extraction
    url, staging = f"{s3_server}/extracted", tmp_path_factory.mktemp("staging")
    uploads = []
    upload, write_bytes = RemoteDir.upload, RemoteDir.write_bytes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RemoteDir, "upload", lambda self, local, rel: (uploads.append(rel), upload(self, local, rel)))
        patch.setattr(RemoteDir, "write_bytes", lambda self, rel, b: (uploads.append(rel), write_bytes(self, rel, b)))
        summary = run_extract(target, data, url, max_shard_bytes=SHARD_BYTES, staging=staging)
    assert summary.manifest is not None and summary.samples == 16
    return url, staging, uploads


def objects(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    return {p[len(root) + 1 :]: fs.cat_file(p) for p in fs.find(root)}


def test_extract_verify_inspect_train_on_s3(reference_extraction, s3_cache, tmp_path):
    _, _, reference = reference_extraction
    url, staging, uploads = s3_cache
    assert uploads[-1] == "manifest.json" and uploads.index("target/head.safetensors") < uploads.index(
        "shards/r0-00000.arrow"
    )
    assert_same_cache(reference, url)  # sample by sample, then verify_cache on the remote cache
    stored = objects(url)
    assert stored["manifest.json"] == (reference / "manifest.json").read_bytes()
    assert not list((staging / "shards").iterdir())  # uploaded shards leave the staging folder

    runner = CliRunner()
    shards = len(json.loads((reference / "manifest.json").read_text())["shards"])
    for args, expect in ((["verify", url], f"ok: {shards} shards, 16 samples"), (["inspect", url], "samples:      16")):
        result = runner.invoke(main, args)
        assert result.exit_code == 0 and expect in result.stdout, result.output
        assert SECRET not in result.output
    assert not any(SECRET.encode() in blob for blob in stored.values())
    assert not any(SECRET.encode() in p.read_bytes() for p in staging.rglob("*") if p.is_file())

    drafter = drafter_json(
        tmp_path / "drafter.json",
        hidden_size=64,
        vocab_size=384,
        target_layer_ids=LAYERS,
        mask_token_id=build_tokenizer().mask_token_id,
    )
    for name, cache, extra in (
        ("local", reference, {}),
        ("s3", url, {}),
        ("s3-fetched", url, {"local_cache": str(tmp_path / "shards"), "local_cache_bytes": 1 << 20}),
    ):
        train(
            tiny_train_config(tmp_path, cache, out=name, steps=3, drafter=str(drafter), token_budget=512, **extra),
            echo=lambda s: None,
        )
    assert len(losses(tmp_path / "local")) == 3
    assert losses(tmp_path / "s3") == losses(tmp_path / "local") == losses(tmp_path / "s3-fetched")


@pytest.mark.parametrize("kill", ["shard", "journal", "manifest"])
def test_resume_after_a_killed_upload(reference_extraction, s3_cache, s3_url, tmp_path, kill):
    """SIGKILL before the 2nd shard's upload, before the journal upload that would list it (then
    resumed from another machine's empty staging folder), or before the manifest's upload."""
    target, data, reference = reference_extraction
    uploads = s3_cache[2]
    second = uploads.index("shards/r0-00001.arrow")
    nth = {"shard": second, "journal": uploads.index("journal/r0.jsonl", second), "manifest": len(uploads) - 1}[
        kill
    ] + 1
    staging = tmp_path / "staging"
    proc = spawn(
        *extract_args(target, data, s3_url), "--staging", staging, env={"DFLASH_CACHE_KILL_AT": f"remote.upload:{nth}"}
    )
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    remote = RemoteDir(s3_url)
    assert not remote.exists("manifest.json")
    listed = remote.read_bytes("journal/r0.jsonl").decode()
    if kill == "journal":
        assert remote.exists("shards/r0-00001.arrow") and "r0-00001" not in listed  # uploaded, not listed
        staging = tmp_path / "other-machine"
    run_extract(target, data, s3_url, max_shard_bytes=SHARD_BYTES, staging=staging)
    assert_same_cache(reference, s3_url)


@pytest.fixture
def remote_random_cache(s3_url, tmp_path):
    """A random cache with rows of about 100 KB, 4 rows a shard, uploaded as it is."""
    local = tmp_path / "local"
    write_random_cache(local, [200, 180, 220, 150] * 3, random_spec(hidden_size=256))
    fs, root = fsspec.core.url_to_fs(s3_url)
    fs.put(str(local) + "/", root, recursive=True)
    return local, s3_url


def test_a_row_is_read_by_byte_ranges(remote_random_cache, monkeypatch):
    local, url = remote_random_cache
    fetched: list[tuple[str, int]] = []
    read_bytes = RemoteDir.read_bytes

    def counting(self, rel, start=None, end=None):
        data = read_bytes(self, rel, start, end)
        fetched.append((rel, len(data)))
        return data

    monkeypatch.setattr(RemoteDir, "read_bytes", counting)
    cache, expect = open_cache(url), open_cache(local)
    assert fetched == [("manifest.json", (local / "manifest.json").stat().st_size)]
    fetched.clear()
    sample = cache[5]
    shard_bytes = cache.shards[1].bytes
    assert [rel for rel, _ in fetched] == ["shards/r0-00001.arrow"] * 2  # the footer, then the record batch
    assert sum(n for _, n in fetched) < 0.5 * shard_bytes
    assert torch.equal(sample.hidden.view(torch.int16), expect[5].hidden.view(torch.int16))
    fetched.clear()
    cache[6]  # same shard: the footer is not fetched again
    assert [rel for rel, _ in fetched] == ["shards/r0-00001.arrow"]


def test_local_folder_holds_whole_shards_within_its_bound(remote_random_cache, tmp_path):
    local, url = remote_random_cache
    expect = open_cache(local)
    bound = int(2.5 * max(s.bytes for s in expect.shards))  # two shards fit, not three
    cache = open_cache(url, tmp_path / "fetched", bound)
    for sid in sorted(expect):
        assert torch.equal(cache[sid].hidden.view(torch.int16), expect[sid].hidden.view(torch.int16))
        on_disk = sum(p.stat().st_size for p in (tmp_path / "fetched").rglob("*.arrow"))
        assert cache._fetcher.held_bytes() <= bound and on_disk <= bound
    assert cache._fetcher.downloads == 3
    cache[0]  # its shard was evicted: fetched again
    assert cache._fetcher.downloads == 4
    again = open_cache(url, tmp_path / "fetched", bound)  # a new process reuses what is there
    again[sorted(expect)[-1]]
    assert again._fetcher.downloads == 0


def test_missing_shards_and_file_urls(remote_random_cache):
    local, url = remote_random_cache
    assert sorted(open_cache(f"file://{local}")) == sorted(open_cache(local))
    RemoteDir(url).delete("shards/r0-00002.arrow")
    cache = open_cache(url)
    with pytest.raises(DFlashCacheError, match=r"r0-00002.arrow: shard listed in the manifest is missing"):
        cache[9]
    with pytest.raises(DFlashCacheError, match=r"r0-00002.arrow: shard listed in the manifest is missing"):
        verify_cache(cache)
    with pytest.raises(DFlashCacheError, match=r"manifest.json: missing; the cache is incomplete"):
        open_cache(url + "-nothing-here")
    with pytest.raises(DFlashCacheError, match=r"^nosuch://bucket/cache: .*nosuch"):
        open_cache("nosuch://bucket/cache")
