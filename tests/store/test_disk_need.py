"""The disk an extraction will take, stated before the first forward and checked against a real
(small) file system."""

import re
import subprocess

import pytest
from click.testing import CliRunner

from dflash_cache.store.disk_need import bytes_per_token
from dflash_cache_cli.main import main
from tests.support.cli import shell_command
from tests.support.extract import extract_args, run_extract


def spec_27b(codec: str, **extra) -> dict:
    return {"codec": codec, "layer_ids": [1, 16, 31, 46, 61], "target": {"hidden_size": 5120}, "topk": 0, **extra}


@pytest.mark.parametrize(
    "codec, extra, expected",
    [
        ("bf16", {}, 51200 + 9),  # 25,600 bf16 values, then input_ids, loss_mask and target_ids (4 + 1 + 4)
        ("bf16-zstd", {}, 51200 * 0.69 + 9),
        ("fp4", {}, 12800 + 1600 + 5 * 4 + 9),  # codes, e4m3 block scales, fp32 layer scales
        ("subspace-fp8-zstd", {"subspace": {"rank": 1024}}, 1024 * 0.84 + 16 * 4 + 9),  # 16 groups of 64
        ("fp8-zstd", {"topk": 8}, 25600 * 0.84 + 5 * 4 + 9 + 8 * 8),
    ],
)
def test_bytes_per_token_at_the_27b_shape(codec, extra, expected):
    assert bytes_per_token(spec_27b(codec, **extra)) == pytest.approx(expected)


def test_extract_refuses_a_file_system_too_small_and_the_flag_overrides(
    qwen3_target_dir, conversations, tmp_path, small_tmpfs
):
    """A real 256 KiB tmpfs (mounted in a user namespace): the run is refused before the target
    loads, naming the estimate and the free space; with --skip-disk-check it starts and runs into
    the full disk instead."""
    disk = tmp_path / "disk"
    disk.mkdir()
    command = shell_command(*extract_args(qwen3_target_dir, conversations, disk / "cache"))
    script = f"""
        mount -t tmpfs -o size=256k tmpfs '{disk}' || exit 99
        {command} 2> '{tmp_path}/refused.err'; echo $? > '{tmp_path}/refused.rc'
        ls -A '{disk}' > '{tmp_path}/left'
        {command} --skip-disk-check 2> '{tmp_path}/forced.err'; echo $? > '{tmp_path}/forced.rc'
    """
    subprocess.run(["unshare", "-Urm", "sh", "-c", script], timeout=600, check=True)
    refused = (tmp_path / "refused.err").read_text()

    assert (tmp_path / "refused.rc").read_text().strip() == "1", refused[-2000:]
    error = refused.strip().splitlines()[-1]
    assert error.startswith("error: the cache will take about ") and "not enough" in error, error
    assert f"bytes a token with bf16-zstd); 0.3 MB free at {disk / 'cache'}" in error, error
    forced = (tmp_path / "forced.err").read_text()
    planned = re.search(r"to extract: 12 samples, (\d+) tokens", forced).group(1)  # the plan's own count
    assert f"({int(planned):,} tokens x 186 bytes" in error, error  # 128 values x 2 bytes x 0.69 + 9
    assert (tmp_path / "forced.rc").read_text().strip() == "1"
    assert "not enough" not in forced and "No space left on device" in forced, forced[-2000:]


def test_inspect_of_a_data_file_tells_the_disk_its_cache_takes(qwen3_target_dir, conversations, tmp_path):
    """The tokens inspect counts are those extract then writes; 2 layers x 64 values a token: bf16
    256 bytes, fp4 64 of codes, 8 of block scales and 8 of layer scales; each 9 of ids and mask."""
    summary = run_extract(qwen3_target_dir, conversations, tmp_path / "cache")
    result = CliRunner().invoke(
        main, ["inspect", str(conversations), "--target", str(qwen3_target_dir), "--layers", "1,4"]
    )
    assert result.exit_code == 0, result.output
    assert f": {summary.tokens:,} tokens within --max-length" in result.output, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if "bytes a token" in line}
    assert "(265 bytes a token)" in lines["bf16"] and "(89 bytes a token)" in lines["fp4"], result.output
