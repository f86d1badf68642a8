"""Hostile caches that declare sizes (a manifest with a valid checksum, written by whoever shared the
cache) that would make a reader allocate terabytes before a row is read: refused in one line."""

import json

import pytest
from click.testing import CliRunner
from dflash_cache_cli.main import main

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.store.manifest import manifest_checksum
from tests.cachegen import random_spec, write_random_cache


def edited(root, edit) -> None:
    """Apply `edit` to the manifest and recompute its checksum (a deliberate edit)."""
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    manifest["checksum"] = manifest_checksum(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stderr


def test_a_sample_longer_than_max_length_is_a_malformed_manifest(tmp_path):
    """A row count of 2^40 tokens: `inspect` listed a bucket for it and `train` sized its buffers by it."""
    root = tmp_path / "cache"
    write_random_cache(root, [30, 20, 25], random_spec(), rows_per_shard=2)

    def huge(manifest):
        shard = manifest["shards"][0]
        shard["tokens"] += (1 << 40) - shard["num_tokens"][0]
        shard["num_tokens"][0] = 1 << 40
        manifest["totals"]["tokens"] += (1 << 40) - 30

    edited(root, huge)
    message = "malformed manifest (a shard lists a sample longer than the spec's max_length 4096)"
    with pytest.raises(DFlashCacheError, match=message.replace("(", r"\(").replace(")", r"\)")):
        open_cache(root)
    for command in ("inspect", "verify"):
        code, err = cli(command, root)
        assert code == 1 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("codec, match", [
    ("bf16", "corrupt bf16 payload: 1920 bytes cannot hold 8246337208320 bytes of planes"),
    ("bf16-zstd", "corrupt bf16-zstd payload: .* bytes cannot hold 8246337208320 bytes of planes"),
    ("fp8-zstd", "corrupt fp8-zstd payload: its zstd frame declares 960 bytes, expected 4123168604160"),
])
def test_a_hidden_size_of_2_36_is_refused_before_its_buffer_is_allocated(tmp_path, codec, match):
    """30 tokens x 2 layers x 2^36: 7.5 TiB of planes were allocated first (MemoryError, or with
    overcommit a buffer as large as the claim) and the payload checked after."""
    root = tmp_path / "cache"
    write_random_cache(root, [30], random_spec(codec=codec, hidden_size=16), rows_per_shard=1)
    edited(root, lambda manifest: manifest["spec"]["target"].update(hidden_size=1 << 36))
    with pytest.raises(DFlashCacheError, match=match):
        open_cache(root)[0]
    code, err = cli("verify", root)
    assert code == 1 and err.count("\n") == 1 and "payload" in err, err


def test_a_target_head_of_another_shape_than_the_spec_is_named_before_the_run(tmp_path):
    """head.safetensors of hidden size 16 in a cache whose spec says 32 (its manifest hash matching
    it): `train` made its run folder and stopped at the first step with `RuntimeError: The size of
    tensor a (32) must match the size of tensor b (16)`; `eval --cache` the same."""
    from dflash_cache.drafter.checkpoint import save_drafter
    from dflash_cache.drafter.model import DFlashDrafter
    from dflash_cache.drafter.config import load_drafter_config
    from tests.test_train_helpers import drafter_json, make_cache, write_head

    cache, drafter = make_cache(tmp_path / "cache", lengths=[20, 30, 25, 40]), drafter_json(tmp_path / "d.json")
    write_head(cache, hidden=16)
    needle = ("head.safetensors does not hold the head of the cache's target (vocabulary 100, hidden size 32): "
              "embed_tokens.weight is [100, 16], not [100, 32]; norm.weight is [16], not [32]")
    code, err = cli("train", "--cache", cache, "--out", tmp_path / "run", "--drafter", drafter, "--steps", 1,
                    "--token-budget", 128, "--max-anchors", 8)
    assert code == 1 and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "run").exists()
    save_drafter(DFlashDrafter(load_drafter_config(drafter)), tmp_path / "checkpoint")
    code, err = cli("eval", "--drafter", tmp_path / "checkpoint", "--cache", cache, "--device", "cpu")
    assert code == 1 and err.count("\n") == 1 and needle in err, err
