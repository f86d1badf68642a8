"""Credentials in a URL (s3://KEY:SECRET@bucket/...) are refused in one line that never shows them,
by every command, before anything is written."""

import pytest
from click.testing import CliRunner

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache_cli.main import main
from tests.support.cli import invoke
from tests.support.tiny import build_target, write_conversations
from tests.support.train import drafter_json

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
URL = f"s3://AKIAEXAMPLE:{SECRET}@bucket/cache"


def test_redact():
    from dflash_cache.store.remote import redact

    assert redact(URL) == "s3://***@bucket/cache"
    assert redact("s3://bucket/a@b/c") == "s3://bucket/a@b/c"  # an @ in the key is not userinfo


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("secrets")
    return (
        build_target(root / "target", "qwen3"),
        write_conversations(root / "data.jsonl", count=2),
        drafter_json(root / "d.json"),
    )


def test_credentials_in_a_url_are_refused_without_showing_them(setup, tmp_path):
    target, data, drafter = setup
    commands = [
        [
            "extract",
            "--target",
            target,
            "--data",
            data,
            "--out",
            URL,
            "--layers",
            "1,4",
            "--staging",
            tmp_path / "staging",
        ],
        ["inspect", URL],
        ["verify", URL],
        ["train", "--cache", URL, "--out", tmp_path / "run", "--drafter", drafter],
    ]
    for command in commands:
        result = invoke(*command)
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
        raise Multiline('Parameter validation failed:\nInvalid bucket name "x": Bucket name must match\nmore')

    monkeypatch.setattr(RemoteDir, "_connect", failing)
    monkeypatch.setattr(RemoteDir, "fs", property(lambda self: failing(self)))
    with pytest.raises(DFlashCacheError) as info:
        RemoteDir("memory://bucket/cache").exists("manifest.json")
    assert str(info.value) == "memory://bucket/cache/manifest.json: Multiline: Parameter validation failed:"


def test_credentials_in_a_server_url_are_sent_but_never_shown(tmp_path):
    """`regenerate --server http://user:password@host` (httpx sends them as basic auth): the run uses
    them, and no message shows them (a server down, retries that fail, a refused request)."""
    from dflash_cache.regenerate.client import RetryPolicy
    from dflash_cache.regenerate.run import RegenerateOptions, regenerate
    from dflash_cache.train.distributed import free_port
    from tests.support.chatservers import ScriptedServer, write_jsonl

    def with_secret(url):
        return url.replace("http://", f"http://bob:{SECRET}@")

    data = write_jsonl(
        tmp_path / "data.jsonl",
        [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "old"}]}],
    )
    dead = with_secret(f"http://127.0.0.1:{free_port()}")
    result = CliRunner().invoke(
        main, ["regenerate", "--data", str(data), "--out", str(tmp_path / "o.jsonl"), "--server", dead]
    )
    assert result.exit_code == 1 and "error: server http://***@127.0.0.1:" in result.stderr, result.stderr
    assert SECRET not in result.output + result.stderr

    fast = RetryPolicy(attempts=2, first_delay_s=0.01, max_delay_s=0.02)
    failing, refusing, good = (
        ScriptedServer(fail_first=9),
        ScriptedServer(fail_first=1, fail_status=400),
        ScriptedServer(),
    )
    try:
        out = tmp_path / "out.jsonl"
        summary = regenerate(
            RegenerateOptions(data=[data], out=out, servers=[with_secret(failing.url)], retry=fast, on_error="skip")
        )
        assert len(summary.skipped) == 1 and "http://***@127.0.0.1" in summary.skipped[0][1]
        assert SECRET not in str(summary.skipped)
        with pytest.raises(DFlashCacheError, match=r"http://\*\*\*@127.0.0.1:\d+/v1 refused the request") as refused:
            regenerate(RegenerateOptions(data=[data], out=out, servers=[with_secret(refusing.url)], retry=fast))
        assert SECRET not in str(refused.value)
        assert (
            regenerate(RegenerateOptions(data=[data], out=out, servers=[with_secret(good.url)], retry=fast)).records
            == 1
        )
        assert SECRET not in out.read_text()
    finally:
        for server in (failing, refusing, good):
            server.close()
