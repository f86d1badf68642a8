import json

from click.testing import CliRunner

from dflash_cache_cli.main import main
from tests.cachegen import write_random_cache


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout if result.exit_code == 0 else result.stderr


def test_inspect_and_verify_a_good_cache(tmp_path):
    write_random_cache(tmp_path, [5, 70, 130, 200, 9, 64], rows_per_shard=2)
    code, out = run("inspect", tmp_path, "--token-budget", 256)
    assert code == 0
    assert "samples:      6" in out and "Batches per epoch:" in out and "Bucket" in out and "compression:" in out
    code, out = run("verify", tmp_path)
    assert code == 0 and out.startswith("ok: 3 shards, 6 samples, 478 tokens")


def test_errors_are_one_line_without_traceback(tmp_path):
    write_random_cache(tmp_path, [50, 60, 70], rows_per_shard=2)
    shard = tmp_path / "shards" / "r0-00001.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    code, out = run("verify", tmp_path)
    assert code == 1 and "r0-00001.arrow" in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1

    manifest = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 3}))
    code, out = run("inspect", tmp_path)
    assert code == 1 and "manifest.json" in out and "newer" in out and len(out.strip().splitlines()) == 1

    code, out = run("verify", tmp_path / "missing")
    assert code == 1 and "no such cache" in out
