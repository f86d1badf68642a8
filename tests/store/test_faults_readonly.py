"""A read-only cache folder (a real read-only bind mount, in a user namespace: the tests run as root,
whom file modes do not stop) gets a message about writability, not about free space."""

import subprocess

import pytest

from tests.support.cli import shell_command
from tests.support.extract import extract_args, run_extract
from tests.support.tiny import build_target, write_conversations


def can_bind_read_only(tmp_path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    script = f"mount --bind '{probe}' '{probe}' && mount -o remount,ro,bind '{probe}'"
    try:
        return (
            subprocess.run(
                ["unshare", "-Urm", "sh", "-c", script], capture_output=True, timeout=30, check=False
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def read_only(path) -> str:
    return f"mount --bind '{path}' '{path}' && mount -o remount,ro,bind '{path}' || exit 99"


@pytest.mark.slow
def test_a_read_only_cache_folder_is_named_as_such(tmp_path):
    if not can_bind_read_only(tmp_path):
        pytest.skip("unprivileged user namespaces are not available for a read-only bind mount")
    target = build_target(tmp_path / "target", "qwen3")
    data = write_conversations(tmp_path / "data.jsonl", count=4)
    whole = tmp_path / "whole"
    run_extract(target, data, whole)
    (whole / "manifest.json").unlink()  # incomplete: extract has to write
    part = tmp_path / "part"
    (part / "shards").mkdir(parents=True)

    script = f"""
        {read_only(whole)}
        {shell_command(*extract_args(target, data, whole))} 2> '{tmp_path}/whole.err'; echo $? > '{tmp_path}/whole.rc'
        {read_only(part / "shards")}
        {shell_command(*extract_args(target, data, part))} 2> '{tmp_path}/part.err'; echo $? > '{tmp_path}/part.rc'
    """
    subprocess.run(["unshare", "-Urm", "sh", "-c", script], timeout=600, check=True)
    for name, start, end in [
        ("whole", f"error: {whole} is not writable (Read-only file system)", "make it writable"),
        ("part", f"error: writing to {part} failed: ", "Read-only file system; make it writable and rerun"),
    ]:
        err = (tmp_path / f"{name}.err").read_text()
        assert (tmp_path / f"{name}.rc").read_text().strip() == "1", err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and lines[0].startswith(start) and end in lines[0] and "free space" not in err, err
