import json

from tests.support.cachegen import write_random_cache
from tests.support.cli import cli


def test_inspect_and_verify_a_good_cache(tmp_path):
    write_random_cache(tmp_path, [5, 70, 130, 200, 9, 64], rows_per_shard=2)
    code, out = cli("inspect", tmp_path, "--token-budget", 256)
    assert code == 0
    assert "samples:      6" in out and "Batches per epoch:" in out and "Bucket" in out and "compression:" in out
    # 2 layers x 32 values a token: raw bf16 128 bytes, fp4 32 of codes, 4 of block scales and 8 of
    # layer scales; each with 9 bytes of token ids and loss mask
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "bytes a token" in line}
    assert "(137 bytes a token)" in lines["bf16"] and "(53 bytes a token)" in lines["fp4"], out
    code, out = cli("verify", tmp_path)
    assert code == 0 and out.startswith("ok: 3 shards, 6 samples, 478 tokens")


def test_errors_are_one_line_without_traceback(tmp_path):
    write_random_cache(tmp_path, [50, 60, 70], rows_per_shard=2)
    shard = tmp_path / "shards" / "r0-00001.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    code, out = cli("verify", tmp_path)
    assert code == 1 and "r0-00001.arrow" in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1

    manifest = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 3}))
    code, out = cli("inspect", tmp_path)
    assert code == 1 and "manifest.json" in out and "newer" in out and len(out.strip().splitlines()) == 1

    code, out = cli("verify", tmp_path / "missing")
    assert code == 1 and "no such cache" in out


def test_a_folder_that_is_no_cache_is_not_called_incomplete(tmp_path):
    """A training run or an export given as a cache was "incomplete (rerun the same extract command
    to finish it)": advice that cannot work for a folder extract never wrote."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    for command in (
        ["inspect", run_dir],
        ["verify", run_dir],
        ["train", "--cache", run_dir, "--out", tmp_path / "new", "--steps", 1],
    ):
        code, out = cli(*command)
        assert code == 1 and out.count("\n") == 1, out
        assert (
            f"error: {run_dir} is not a cache (it has no manifest.json and no journal/); give a folder that "
            "`dflash-cache extract` wrote" in out
        ), out
    assert not (tmp_path / "new").exists()
    write_random_cache(tmp_path / "cut", [5, 9])
    (tmp_path / "cut" / "manifest.json").unlink()  # journals but no manifest: an extraction to finish
    code, out = cli("verify", tmp_path / "cut")
    assert code == 1 and "manifest.json: missing; the cache is incomplete (rerun the same extract command" in out, out


def test_a_cut_shard_is_named_as_cut_by_every_reader(tmp_path):
    """`inspect --sample` and `eval --cache` on a truncated shard said 'cannot open shard (Not an Arrow
    file)'; `verify` and `train` said what was wrong."""
    write_random_cache(tmp_path, [5, 9, 7, 6], rows_per_shard=2)
    shard = tmp_path / "shards" / "r0-00000.arrow"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    for command in (["inspect", tmp_path, "--sample", 0], ["verify", tmp_path]):
        code, out = cli(*command)
        assert code == 1 and out.count("\n") == 1, out
        assert f"{shard}: {size // 2} bytes, the manifest says {size} (truncated or replaced)" in out, out
