"""Credentials in a URL (s3://KEY:SECRET@bucket/...) are refused in one line that never shows them,
by every command, before anything is written."""

import pytest
from click.testing import CliRunner
from dflash_cache_cli.main import main

from dflash_cache import DFlashCacheError, open_cache
from tests.test_train_helpers import drafter_json
from tests.tiny import build_target, write_conversations

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
URL = f"s3://AKIAEXAMPLE:{SECRET}@bucket/cache"


def test_redact():
    from dflash_cache.store.remote import redact

    assert redact(URL) == "s3://***@bucket/cache"
    assert redact("s3://bucket/a@b/c") == "s3://bucket/a@b/c"  # an @ in the key is not userinfo


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("secrets")
    return build_target(root / "target", "qwen3"), write_conversations(root / "data.jsonl", count=2), drafter_json(root / "d.json")


def test_credentials_in_a_url_are_refused_without_showing_them(setup, tmp_path):
    target, data, drafter = setup
    commands = [
        ["extract", "--target", target, "--data", data, "--out", URL, "--layers", "1,4", "--staging", tmp_path / "staging"],
        ["inspect", URL],
        ["verify", URL],
        ["train", "--cache", URL, "--out", tmp_path / "run", "--drafter", drafter],
    ]
    for command in commands:
        result = CliRunner().invoke(main, [str(a) for a in command])
        err = result.stderr
        assert result.exit_code == 1 and err.count("\n") == 1, err
        assert err.startswith("error: s3://***@bucket/cache: credentials in the URL are not accepted"), err
        assert SECRET not in err + result.stdout and "AKIAEXAMPLE" not in err
    assert not (tmp_path / "staging").exists() and not (tmp_path / "run").exists()
    with pytest.raises(DFlashCacheError, match=r"^s3://\*\*\*@bucket/cache: credentials") as info:
        open_cache(URL)
    assert SECRET not in str(info.value)


def test_remote_errors_are_one_line(monkeypatch):
    """A backend error of many lines (botocore's bucket-name validation is three) becomes its first."""
    from dflash_cache.store.remote import RemoteDir

    class Multiline(Exception):
        pass

    def failing(self):
        raise Multiline("Parameter validation failed:\nInvalid bucket name \"x\": Bucket name must match\nmore")

    monkeypatch.setattr(RemoteDir, "_connect", failing)
    monkeypatch.setattr(RemoteDir, "fs", property(lambda self: failing(self)))
    with pytest.raises(DFlashCacheError) as info:
        RemoteDir("memory://bucket/cache").exists("manifest.json")
    assert str(info.value) == "memory://bucket/cache/manifest.json: Multiline: Parameter validation failed:"
