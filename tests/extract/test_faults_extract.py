"""Extraction faults done for real where the machine allows: a second process on the same --out,
a file-size limit (a full disk) in the middle of a shard, an out-of-memory batch."""

import json
import resource
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.store.verify import verify_cache
from dflash_cache.target.runner import TargetRunner
from tests.support.cli import invoke, shell_command, spawn, wait_until_stopped
from tests.support.extract import SHARD_BYTES, assert_same_cache, extract_args, run_extract
from tests.support.fulldisk import fill_at
from tests.support.tiny import CORPUS, build_target, write_conversations

LONG = 9  # the sample id of the one long conversation


def write_data(path):
    """Twelve short conversations, one of them (LONG) replaced by a long one: its row alone is bigger
    than the file-size limit below, and it is the one that never fits in memory."""
    write_conversations(path, count=12, seed=5)
    lines = path.read_text().splitlines()
    words = " ".join(CORPUS).split()
    text = " ".join(words[i % len(words)] for i in range(700))
    lines[LONG] = json.dumps(
        {"messages": [{"role": "user", "content": "Repeat."}, {"role": "assistant", "content": text}]}
    )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("extract_faults")
    target = build_target(root / "target", "qwen3")
    data = write_data(root / "data.jsonl")
    reference = root / "reference"
    run_extract(target, data, reference, max_shard_bytes=SHARD_BYTES)
    return target, data, reference


def snapshot(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_second_process_on_the_same_out_is_refused_naming_the_holder(setup, tmp_path):
    target, data, _ = setup
    out = tmp_path / "cache"
    first = spawn(*extract_args(target, data, out), env={"DFLASH_CACHE_KILL_AT": "extract.forward:2:STOP"})
    try:
        wait_until_stopped(first)  # frozen mid-extraction, holding the lock
        before = snapshot(out)
        start = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "dflash_cache_cli.main", *map(str, extract_args(target, data, out))],
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert second.returncode == 1
        assert second.stderr.startswith(f"error: {out} is being written by pid {first.pid} on {socket.gethostname()};")
        assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
        assert snapshot(out) == before  # the refused run touched nothing
        assert time.monotonic() - start < 120  # refused at once: it never waits for the holder
    finally:
        first.kill()
        first.communicate(timeout=60)


@pytest.mark.slow
def test_readers_during_an_extraction_name_it_and_disturb_nothing(setup, tmp_path):
    """`inspect`, `verify` and `train` on a cache an extraction is still writing: one line naming the
    running extraction (they advised to "rerun the same extract command", which the lock refuses);
    the extraction, let go on, ends with the same cache as an uninterrupted run."""

    from tests.support.train import drafter_json

    target, data, reference = setup
    out = tmp_path / "cache"
    drafter = drafter_json(
        tmp_path / "d.json", hidden_size=64, vocab_size=384, mask_token_id=383, target_layer_ids=[1, 4]
    )
    first = spawn(*extract_args(target, data, out), env={"DFLASH_CACHE_KILL_AT": "shard.committed:2:STOP"})
    try:
        wait_until_stopped(first)
        before = snapshot(out)
        running = f"missing; {out} is being written by pid {first.pid} on {socket.gethostname()} (an extraction that has not finished)"
        for args in (
            ["inspect", out],
            ["verify", out],
            ["train", "--cache", out, "--out", tmp_path / "run", "--drafter", drafter, "--steps", 1],
        ):
            result = invoke(*args)
            assert result.exit_code == 1 and result.stderr.count("\n") == 1 and running in result.stderr, result.stderr
        assert snapshot(out) == before and not (tmp_path / "run").exists()
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=240)
        assert first.returncode == 0, err[-2000:]
    finally:
        first.kill()
        first.communicate(timeout=60)
    assert_same_cache(reference, out)


def limit_file_size(limit: int):
    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG

    return preexec


def assert_stopped_cleanly(out, returncode: int, stderr: str, reason: str) -> dict[str, list[int]]:
    """One clear line; the shards committed before the failure are kept, the one being written is
    not. Returns the committed shards' sample ids by file name."""
    assert returncode == 1, stderr[-2000:]
    error = stderr.strip().splitlines()[-1]
    assert reason in error and "rerun the same command" in error and "Traceback" not in stderr, stderr
    journal_file = out / "journal" / "r0.jsonl"
    journal = [json.loads(line) for line in journal_file.read_text().splitlines()] if journal_file.exists() else []
    committed = {s["shard"]["path"].split("/")[1]: s["shard"]["sample_ids"] for s in journal if "shard" in s}
    assert {p.name for p in (out / "shards").iterdir()} == set(committed)  # no partial shard, no .tmp
    assert not (out / "manifest.json").exists()
    return committed


@pytest.mark.slow
def test_file_size_limit_during_a_shard_write(setup, tmp_path):
    """RLIMIT_FSIZE below the long sample's shard: the write fails with EFBIG; once the limit is
    lifted the same command completes the cache."""
    target, data, reference = setup
    out = tmp_path / "cache"
    limit = 160 << 10  # above every file but the shard holding the long sample
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_cache_cli.main", *map(str, extract_args(target, data, out))],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        preexec_fn=limit_file_size(limit),
    )
    committed = assert_stopped_cleanly(out, proc.returncode, proc.stderr, "File too large")
    assert all(LONG not in ids for ids in committed.values())
    run_extract(target, data, out, max_shard_bytes=SHARD_BYTES)
    assert_same_cache(reference, out)


@pytest.mark.slow
@pytest.mark.usefixtures("small_tmpfs")
def test_full_disk_during_a_shard_write(setup, tmp_path):
    """A real full disk: a 540 KiB tmpfs (in a user namespace, no privileges needed) fills up while
    shards are written; after it is grown, the same command completes the cache."""
    target, data, reference = setup
    disk, saved = tmp_path / "disk", tmp_path / "saved"
    disk.mkdir()
    # the disk is to fill up mid-run, not be refused before
    command = shell_command(*extract_args(target, data, disk / "cache"), "--skip-disk-check")
    script = f"""
        mount -t tmpfs -o size=540k tmpfs '{disk}' || exit 99
        {command} 2> '{tmp_path}/first.err'; echo $? > '{tmp_path}/first.rc'
        cp -r '{disk}/cache' '{saved}'
        mount -o remount,size=4m '{disk}' || exit 98
        {command} 2> '{tmp_path}/second.err'; echo $? > '{tmp_path}/second.rc'
        cp -r '{disk}/cache' '{tmp_path}/cache'
    """
    subprocess.run(["unshare", "-Urm", "sh", "-c", script], timeout=600, check=True)
    first = (tmp_path / "first.err").read_text()
    assert assert_stopped_cleanly(saved, int((tmp_path / "first.rc").read_text()), first, "No space left on device")
    assert (tmp_path / "second.rc").read_text().strip() == "0", (tmp_path / "second.err").read_text()[-2000:]
    assert_same_cache(reference, tmp_path / "cache")


@pytest.mark.slow
@pytest.mark.usefixtures("small_tmpfs")
def test_full_disk_while_the_manifest_is_written(setup, tmp_path):
    """It was a bare `OSError: [Errno 28]` naming no file, and left `manifest.json.tmp`."""
    target, data, reference = setup
    disk = tmp_path / "disk"
    command = extract_args(target, data, disk / "cache")
    first, then = fill_at("manifest.write:1", command, command, disk, tmp_path)
    cache = disk / "cache"
    error = first.stderr.strip().splitlines()[-1]
    assert first.returncode == 1 and "Traceback" not in first.stderr, first.stderr[-2000:]
    assert error.startswith(
        f"error: writing {cache / 'manifest.json'} failed: No space left on device; "
        f"free space in {cache} (0.0 MB free now)"
    ), error
    assert "and rerun the same extract command to finish the cache" in error, error
    left = {p.name for p in (tmp_path / "after-first" / "cache").iterdir()}
    assert "manifest.json" not in left and "manifest.json.tmp" not in left, left
    assert then.returncode == 0, then.stderr[-2000:]
    assert_same_cache(reference, tmp_path / "after-then" / "cache")


class OutOfMemoryRunner(TargetRunner):
    """Raises CUDA's OOM error for a forward of several samples over `budget` tokens, and for the long
    sample even alone."""

    budget = 150

    def run_batch(self, fb):
        if int(fb.lengths.max()) > 1000 or (len(fb.sample_ids) > 1 and int(fb.lengths.sum()) > self.budget):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return super().run_batch(fb)


def test_a_sample_that_never_fits_is_named_or_skipped(setup, tmp_path, monkeypatch):
    target, data, reference = setup
    monkeypatch.setattr("dflash_cache.extract.worker.TargetRunner", OutOfMemoryRunner)
    with pytest.raises(DFlashCacheError, match=rf"sample {LONG} \(\d+ tokens\) does not fit in GPU memory even alone"):
        run_extract(target, data, tmp_path / "a", max_shard_bytes=SHARD_BYTES)
    assert not (tmp_path / "a" / "manifest.json").exists()

    out = tmp_path / "b"
    run_extract(target, data, out, max_shard_bytes=SHARD_BYTES, on_bad_sample="skip")
    cache, ref = open_cache(out), open_cache(reference)
    assert [s["sample_id"] for s in cache.manifest["skipped"]] == [LONG]
    assert "does not fit in GPU memory" in cache.manifest["skipped"][0]["reason"]
    assert sorted(cache) == sorted(set(ref) - {LONG})
    for sid in cache:  # batches were split: the same values, up to bf16 kernel blocking
        assert torch.equal(cache[sid].input_ids, ref[sid].input_ids)
        torch.testing.assert_close(cache[sid].hidden, ref[sid].hidden, atol=2e-2, rtol=2e-2)
    verify_cache(cache)


@pytest.mark.gpu
def test_real_cuda_oom_splits_down_to_single_samples(tmp_path):
    """This process's CUDA memory is capped between one sample's peak and two samples': the batch of
    eight runs out of memory for real and is split down to single samples, with the same outputs;
    under a cap below one sample's peak, the sample is named.

    The target is wide (hidden 1024) so that a sample's activations, not the allocator's 20 MB
    segments, decide what fits: with the usual hidden 64, one sample reserved 25.2 MB and two 27.3 MB
    on an H200, and the premise below failed."""
    import numpy as np

    from dflash_cache.data.dataset import Sample
    from dflash_cache.extract.buckets import BucketLayout
    from dflash_cache.extract.split import SampleOutOfMemory, run_with_split
    from dflash_cache.target.target import load_target

    target = load_target(build_target(tmp_path / "wide", "qwen3", hidden=1024), "cuda:0")
    runner = TargetRunner(target, [1, 4])
    lengths = torch.full((8,), 2048)
    input_ids = torch.randint(0, target.vocab_size, (8, 2048), generator=torch.Generator().manual_seed(0)).cuda()
    samples = [Sample(i, input_ids[i].cpu().numpy().astype(np.int32), np.ones(2048, dtype=bool)) for i in range(8)]
    layout = BucketLayout(token_budget=8 * 2048, max_length=2048)  # one batch of (8, 2048); halves of 4, 2, 1 rows
    whole = runner.run(input_ids, lengths).hidden.cpu()

    def reserved_peak(batch: int) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        runner.run(input_ids[:batch], lengths[:batch])
        torch.cuda.synchronize()
        return torch.cuda.max_memory_reserved()

    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    one, two = reserved_peak(1) - base, reserved_peak(2) - base
    assert two > 1.5 * one  # activations, not weights, decide what fits
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction((base + (one + two) / 2) / total)
        parts = [(p.sample_ids, p.output.hidden.cpu()) for p in run_with_split(runner, layout, samples, "cuda:0")]
        assert [ids for ids, _ in parts] == [[i] for i in range(8)]
        for ids, hidden in parts:
            torch.testing.assert_close(hidden[0], whole[ids[0]], atol=2e-2, rtol=2e-2)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction((base + one / 2) / total)
        with pytest.raises(SampleOutOfMemory, match="sample 0 \\(2048 tokens\\) does not fit"):
            list(run_with_split(runner, layout, samples, "cuda:0"))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
