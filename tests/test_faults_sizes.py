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


@pytest.mark.parametrize("length", [1 << 40, -1])
def test_a_shard_whose_arrow_lengths_lie_is_one_line_not_a_crash(tmp_path, length):
    """A row's list columns declaring 2^40 (or -1) values over a buffer of 37: Arrow checks buffer
    sizes against declared lengths only when asked, and reading the columns killed the process
    (SIGBUS, SIGSEGV). The manifest's sha256 and checksum are recomputed, as whoever crafted it would."""
    import hashlib
    import struct
    import subprocess
    import sys

    root = tmp_path / "cache"
    write_random_cache(root, [37], random_spec(), rows_per_shard=1)
    shard = root / "shards" / "r0-00000.arrow"
    data = bytearray(shard.read_bytes())
    declared = [i for i in range(len(data) - 8) if data[i:i + 8] == struct.pack("<q", 37)]
    assert len(declared) >= 3  # the lengths of the input_ids, loss_mask and target_ids values
    for i in declared[:3]:
        data[i:i + 8] = struct.pack("<q", length)
    shard.write_bytes(bytes(data))
    edited(root, lambda manifest: manifest["shards"][0].update(sha256=hashlib.sha256(data).hexdigest()))
    for command in (["inspect", root, "--sample", 0], ["verify", root]):
        result = subprocess.run([sys.executable, "-m", "dflash_cache_cli.main", *map(str, command)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 1, (result.returncode, result.stderr[-500:])
        assert result.stderr.count("\n") == 1 and "r0-00000.arrow: row 0 unreadable (In column 2: Invalid: List child array invalid" in result.stderr, result.stderr


@pytest.mark.parametrize("kind", ["file", "stream"])
@pytest.mark.parametrize("length", [1 << 40, -1])
def test_an_arrow_data_file_whose_lengths_lie_is_one_line_not_a_crash(tmp_path, kind, length):
    """`--data x.arrow` (a data set someone shared) whose input_ids values declare 2^40 or -1 entries:
    -1 aborted the reader (`Check failed: (off) <= (length)`, SIGABRT); 2^40 was read as if declared
    right. Both are damaged files, named as such."""
    import struct
    import subprocess
    import sys

    import pyarrow as pa

    path = tmp_path / "data.arrow"
    table = pa.table({"input_ids": pa.array([list(range(100, 140)), list(range(7))], type=pa.list_(pa.int32()))})
    with (pa.ipc.new_file if kind == "file" else pa.ipc.new_stream)(str(path), table.schema) as writer:
        writer.write_table(table)
    data = bytearray(path.read_bytes())
    node = data.find(struct.pack("<qq", 47, 0))  # the values' field node: 47 entries, no nulls
    assert node > 0
    data[node:node + 8] = struct.pack("<q", length)
    path.write_bytes(bytes(data))
    code = (f"from dflash_cache.data.readers import read_records\nfrom dflash_cache import DFlashCacheError\n"
            f"try:\n    list(read_records({str(path)!r}))\nexcept DFlashCacheError as e:\n    print(e)\n    raise SystemExit(1)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr[-500:])
    assert result.stdout.startswith(f"{path}: unreadable data part-way through the file (In column 0: Invalid: List child array invalid")


DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON nested past Python's recursion limit


def test_json_nested_100000_deep_is_named_as_the_file_it_is(tmp_path):
    """A manifest, a journal line, a checkpoint's drafter config and training state, a run's run.json: `json` raised a bare
    `RecursionError: maximum recursion depth exceeded while decoding a JSON array` naming no file."""
    from dflash_cache.drafter.checkpoint import CONFIG_FILE, save_drafter
    from dflash_cache.drafter.config import load_drafter_config
    from dflash_cache.drafter.model import DFlashDrafter
    from dflash_cache.store.manifest import read_journals
    from tests.test_train_helpers import drafter_json, make_cache

    cache = make_cache(tmp_path / "cache", lengths=[20, 30, 25, 40])
    journal = cache / "journal" / "r0.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join([lines[0], DEEP, *lines[1:]]) + "\n")
    with pytest.raises(DFlashCacheError, match=r"r0.jsonl:2: corrupt journal line"):
        read_journals(cache)

    drafter = drafter_json(tmp_path / "d.json")
    save_drafter(DFlashDrafter(load_drafter_config(drafter)), tmp_path / "checkpoint")
    (tmp_path / "checkpoint" / CONFIG_FILE).write_text(DEEP)
    code, err = cli("export", tmp_path / "checkpoint", "--out", tmp_path / "export")
    assert code == 1 and err.count("\n") == 1 and f"{tmp_path / 'checkpoint' / CONFIG_FILE}: unreadable (maximum recursion" in err, err

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(DEEP)
    code, err = cli("train", "--cache", cache, "--out", run, "--drafter", drafter, "--steps", 2, "--token-budget", 128,
                    "--max-anchors", 8, "--resume")
    assert code == 1 and err.count("\n") == 1 and f"--resume: {run / 'run.json'} is unreadable (maximum recursion" in err, err

    from safetensors.torch import save_file

    from dflash_cache.train.state_io import load_state

    save_file({}, tmp_path / "checkpoint" / "train_state.safetensors")
    (tmp_path / "checkpoint" / "train_state.json").write_text(DEEP)
    with pytest.raises(DFlashCacheError, match=r"checkpoint: unreadable training state \(maximum recursion"):
        load_state(tmp_path / "checkpoint", "train_state")

    (cache / "manifest.json").write_text(DEEP)
    for command in ("inspect", "verify"):
        code, err = cli(command, cache)
        assert code == 1 and err.count("\n") == 1 and "manifest.json: unreadable manifest (maximum recursion" in err, err



# Reads the tokenized data in a process of its own (a crash is then a return code); no tokenizer is
# given, as nothing is to be tokenized: a file found damaged is an error, not made again.
TOKENIZED = """
import sys
from dflash_cache import DFlashCacheError
from dflash_cache.data.tokenized import tokenized_data
try:
    data = tokenized_data([sys.argv[1]], None, 64, "t" * 64, sys.argv[2], workers=0)
    print([data.samples([i])[i].input_ids.tolist() for i in data.sample_ids.tolist()])
except DFlashCacheError as e:
    print(e)
    raise SystemExit(1)
"""


@pytest.mark.parametrize("lie", ["values", "every length"])
def test_a_tokenized_file_whose_arrow_lengths_lie_is_one_line_not_a_crash(tmp_path, tokenizer, lie):
    """KEY.arrow (the tokenized data kept in --tokenized-dir) crafted so that its record batch's lengths
    lie: a list's values declaring 2^40 entries over 47 was taken as damage and the file silently
    tokenized again; a batch and its columns all declaring 2^20 rows (KEY.json saying so too) killed
    the reader (SIGBUS) as it indexed the file."""
    import struct
    import subprocess
    import sys
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_cache.data.tokenized import tokenized_data

    data, folder = tmp_path / "tokens.parquet", tmp_path / "tok"
    pq.write_table(pa.table({"input_ids": [list(range(100, 140)), list(range(200, 207))]}), data)
    arrow = tokenized_data([data], tokenizer, 64, "t" * 64, folder, workers=0).path
    run = lambda: subprocess.run([sys.executable, "-c", TOKENIZED, str(data), str(folder)],  # noqa: E731
                                 capture_output=True, text=True, timeout=120)
    read = run()  # the file as written reads back in the other process
    assert read.returncode == 0 and read.stdout.strip() == str([list(range(100, 140)), list(range(200, 207))]), read
    raw = bytearray(arrow.read_bytes())
    if lie == "values":
        node = raw.find(struct.pack("<qq", 47, 0))  # the input_ids values' field node: 47 entries, no nulls
        assert node > 0
        raw[node:node + 8] = struct.pack("<q", 1 << 40)
        arrow.with_suffix(".index.npy").unlink()  # indexed again from the crafted file
    else:  # the batch's length and its columns' field nodes: no other int64 in the file is 2
        places = [i for i in range(len(raw) - 8) if raw[i:i + 8] == struct.pack("<q", 2)]
        assert len(places) >= 5
        for i in places:
            raw[i:i + 8] = struct.pack("<q", 1 << 20)
        info = arrow.with_suffix(".json")
        info.write_text(json.dumps({**json.loads(info.read_text()), "rows": 1 << 20}))
    arrow.write_bytes(bytes(raw))
    result = run()
    assert result.returncode == 1, (result.returncode, result.stderr[-500:])
    assert result.stdout.startswith(f"{arrow}: unreadable data part-way through the file (") and result.stdout.count("\n") == 1, result.stdout
    assert result.stdout.rstrip().endswith("; delete it and rerun to tokenize the data again"), result.stdout
    assert arrow.read_bytes() == raw  # not silently made again
