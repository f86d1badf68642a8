"""The cache spec names the target by its weights and holds --token-budget: resuming with other
weights (same config, tokenizer and folder name) or another token budget is refused naming it."""

import shutil

import pytest

from dflash_cache import DFlashCacheError
from dflash_cache.store.manifest import read_manifest
from tests.test_extract import run_extract
from tests.tiny import build_target, write_conversations


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = build_target(root / "a" / "target", "qwen3", seed=0)
    other = build_target(root / "b" / "target", "qwen3", seed=1)  # same name, config and tokenizer
    assert (target / "config.json").read_bytes() == (other / "config.json").read_bytes()
    data = write_conversations(root / "data.jsonl", count=6, seed=4)
    return target, other, data


def test_resume_with_other_weights_or_token_budget_is_refused(setup, tmp_path):
    target, other, data = setup
    out = tmp_path / "cache"
    run_extract(target, data, out)
    spec = read_manifest(out)["spec"]
    assert spec["token_budget"] == 300 and spec["target"]["weights"]["content_hashed"] is True
    (out / "manifest.json").unlink()  # as if interrupted: a rerun would resume
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(
        DFlashCacheError, match=r"other settings \(target\.weights\.sha256: [0-9a-f]{12}\.\.\. -> [0-9a-f]{12}"
    ):
        run_extract(other, data, out)
    with pytest.raises(DFlashCacheError, match=r"other settings \(.*token_budget: 300 -> 200\)"):
        run_extract(target, data, out, token_budget=200)
    with pytest.raises(DFlashCacheError, match=r"target\.weights\.content_hashed: True -> False"):
        run_extract(target, data, out, hash_weights=False)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    run_extract(target, data, out)  # the same settings resume
    assert read_manifest(out)["spec"] == spec


def test_resume_of_a_cache_another_format_version_started_is_refused(setup, tmp_path, monkeypatch):
    """An extraction started by an older dflash-cache (rows without record ids) is not continued
    by this one, which would mix rows of both kinds in one cache."""
    from dflash_cache.extract import spec as spec_module

    target, _, data = setup
    out = tmp_path / "cache"
    monkeypatch.setattr(spec_module, "FORMAT_VERSION", spec_module.FORMAT_VERSION - 1)
    run_extract(target, data, out)
    (out / "manifest.json").unlink()
    monkeypatch.undo()
    with pytest.raises(
        DFlashCacheError,
        match=rf"other settings \(format_version: {spec_module.FORMAT_VERSION - 1} -> {spec_module.FORMAT_VERSION}\)",
    ):
        run_extract(target, data, out)


def test_the_quick_weights_hash_tells_weights_apart_and_is_recorded(setup, tmp_path):
    from dflash_cache.target.weights import weights_digest

    target, other, _ = setup
    quick = weights_digest(target, content=False)
    assert quick["content_hashed"] is False
    assert quick != weights_digest(other, content=False)
    copy = shutil.copytree(target, tmp_path / "copy" / "target")
    assert weights_digest(copy, content=False) == quick  # a copy is the same target


def test_the_content_hash_is_computed_once_per_file(setup, tmp_path, monkeypatch):
    from dflash_cache.target import weights
    from dflash_cache.target.weights import weights_digest

    target, _, _ = setup
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    hashed = []
    monkeypatch.setattr(weights, "file_sha256", lambda path: hashed.append(path.name) or f"{path.stat().st_size:064x}")
    copy = shutil.copytree(target, tmp_path / "target")
    first = weights_digest(copy)
    assert hashed == ["model.safetensors"]
    assert weights_digest(copy) == first and hashed == ["model.safetensors"]  # read from the memo
    with open(copy / "model.safetensors", "r+b") as f:  # rewritten in place: size kept, change time not
        f.write(f.read(1))
    weights_digest(copy)
    assert hashed == ["model.safetensors"] * 2
