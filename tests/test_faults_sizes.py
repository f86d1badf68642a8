"""Hostile caches that declare sizes (a manifest with a valid checksum, written by whoever shared the
cache) that would make a reader allocate terabytes before a row is read: refused in one line."""

import json
import re

import pytest
from click.testing import CliRunner

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.store.manifest import manifest_checksum
from dflash_cache_cli.main import main
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


def write_wide_cache(root, hidden_size: int, num_tokens: int = 30, layers: int = 2) -> None:
    """A complete fp8-zstd cache of one sample whose spec declares `hidden_size` and whose zstd frame
    truly decodes to num_tokens x layers x hidden_size bytes (all zeros: zstd shrinks them 30,000x),
    written by the cache's own writer: its checksums, sha256 and manifest are all as extract makes them."""
    import numpy as np

    from dflash_cache.store.codecs import compress
    from dflash_cache.store.manifest import build_manifest, read_journals, write_manifest
    from dflash_cache.store.schema import Row
    from dflash_cache.store.writer import ShardWriter

    spec = random_spec(codec="fp8-zstd", layer_ids=tuple(range(1, layers + 1)), hidden_size=hidden_size)
    writer = ShardWriter(root, rank=0, spec=spec)
    ids = np.arange(num_tokens, dtype=np.int32)
    writer.append(
        Row(
            sample_id=0,
            input_ids=ids,
            loss_mask=np.ones(num_tokens, bool),
            target_ids=ids,
            hidden=compress(np.zeros(num_tokens * layers * hidden_size, np.uint8), "fp8-zstd"),
            hidden_scales=np.ones((num_tokens, layers), np.float32).tobytes(),
        )
    )
    writer.commit()
    write_manifest(root, build_manifest(read_journals(root)))


def test_a_width_the_shards_bytes_cannot_hold_is_refused_where_the_manifest_is_read(tmp_path):
    """A 5.3 KB cache whose spec says hidden size 2^20 and whose frame truly decodes to the 60 MiB a row
    of 30 tokens then takes: every reader sized its buffers by the width and decoded it (`verify` passed,
    1.0 GB resident at its peak; at hidden size 2^26 a row is 4 GB). fp8-zstd shrinks activations
    1.2x; the rule allows 16x."""
    root = tmp_path / "cache"
    write_wide_cache(root, hidden_size=1 << 20)
    size = (root / "shards" / "r0-00000.arrow").stat().st_size
    assert size < 8000
    message = (
        f"malformed manifest (spec.target.hidden_size 1048576 x 2 layer_ids is too wide for shard "
        f"shards/r0-00000.arrow: its 30 tokens would decode to 62914560 bytes, more than its {size} bytes can "
        "hold (fp8-zstd decodes at most 16 bytes a stored byte))"
    )
    with pytest.raises(DFlashCacheError, match=re.escape(f"{root / 'manifest.json'}: {message}")):
        open_cache(root)
    from tests.test_train_helpers import drafter_json

    train = [
        "train",
        "--cache",
        root,
        "--out",
        tmp_path / "run",
        "--drafter",
        drafter_json(tmp_path / "d.json"),
        "--steps",
        1,
        "--token-budget",
        128,
        "--max-anchors",
        8,
    ]
    for command in (["inspect", root, "--sample", 0], ["verify", root], train):
        code, err = cli(*command)
        assert code == 1 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()
    # The same file at a width it can hold is read (its rows are all zeros).
    honest = tmp_path / "honest"
    write_wide_cache(honest, hidden_size=64)
    assert not open_cache(honest)[0].hidden.any()


@pytest.mark.parametrize(
    "codec, hidden_size, match",
    [
        ("bf16", 1 << 36, "bf16 decodes at most 1 bytes"),
        ("bf16-zstd", 1 << 36, "bf16-zstd decodes at most 2 bytes"),
        ("fp8-zstd", 1 << 36, "fp8-zstd decodes at most 16 bytes"),
        ("bf16", 17, "corrupt bf16 payload: 1920 bytes cannot hold 2040 bytes of planes"),
        ("fp8-zstd", 17, "corrupt fp8-zstd payload: its zstd frame declares 960 bytes, expected 1020"),
    ],
)
def test_a_wider_hidden_size_is_refused_before_its_buffer_is_allocated(tmp_path, codec, hidden_size, match):
    """Hidden size 16 edited (checksum recomputed): 2^36 made 30 tokens x 2 layers 7.5 TiB of planes,
    allocated first (MemoryError, or with overcommit a buffer as large as the claim); it is now too wide
    for the shard's bytes. A width the bytes could hold (17) is refused by each row's payload check."""
    root = tmp_path / "cache"
    write_random_cache(root, [30], random_spec(codec=codec, hidden_size=16), rows_per_shard=1)
    edited(root, lambda manifest: manifest["spec"]["target"].update(hidden_size=hidden_size))
    with pytest.raises(DFlashCacheError, match=re.escape(match)):
        open_cache(root)[0]
    code, err = cli("verify", root)
    assert code == 1 and err.count("\n") == 1 and match in err, err


def test_a_row_of_another_length_than_the_manifest_says_is_refused(tmp_path):
    """The width is checked against the manifest's token counts, so every reader holds a row to its count
    (`cache[i]`, as `inspect --sample` reads, took the row's own: 30 tokens where the manifest says 29)."""
    root = tmp_path / "cache"
    write_random_cache(root, [30], random_spec(), rows_per_shard=1)

    def shorter(manifest):
        manifest["shards"][0].update(num_tokens=[29], tokens=29)

    edited(root, shorter)
    with pytest.raises(DFlashCacheError, match="r0-00000.arrow: row 0 holds 30 tokens, the manifest says 29"):
        open_cache(root)[0]


def test_a_target_head_of_another_shape_than_the_spec_is_named_before_the_run(tmp_path):
    """head.safetensors of hidden size 16 in a cache whose spec says 32 (its manifest hash matching
    it): `train` made its run folder and stopped at the first step with `RuntimeError: The size of
    tensor a (32) must match the size of tensor b (16)`; `eval --cache` the same."""
    from dflash_cache.drafter.checkpoint import save_drafter
    from dflash_cache.drafter.config_file import load_drafter_config
    from dflash_cache.drafter.model import DFlashDrafter
    from tests.test_train_helpers import drafter_json, make_cache, write_head

    cache, drafter = make_cache(tmp_path / "cache", lengths=[20, 30, 25, 40]), drafter_json(tmp_path / "d.json")
    write_head(cache, hidden=16)
    needle = (
        "head.safetensors does not hold the head of the cache's target (vocabulary 100, hidden size 32): "
        "embed_tokens.weight is [100, 16], not [100, 32]; norm.weight is [16], not [32]"
    )
    code, err = cli(
        "train",
        "--cache",
        cache,
        "--out",
        tmp_path / "run",
        "--drafter",
        drafter,
        "--steps",
        1,
        "--token-budget",
        128,
        "--max-anchors",
        8,
    )
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
    declared = [i for i in range(len(data) - 8) if data[i : i + 8] == struct.pack("<q", 37)]
    assert len(declared) >= 3  # the lengths of the input_ids, loss_mask and target_ids values
    for i in declared[:3]:
        data[i : i + 8] = struct.pack("<q", length)
    shard.write_bytes(bytes(data))
    edited(root, lambda manifest: manifest["shards"][0].update(sha256=hashlib.sha256(data).hexdigest()))
    for command in (["inspect", root, "--sample", 0], ["verify", root]):
        result = subprocess.run(
            [sys.executable, "-m", "dflash_cache_cli.main", *map(str, command)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 1, (result.returncode, result.stderr[-500:])
        assert (
            result.stderr.count("\n") == 1
            and "r0-00000.arrow: row 0 unreadable (In column 2: Invalid: List child array invalid" in result.stderr
        ), result.stderr


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
    data[node : node + 8] = struct.pack("<q", length)
    path.write_bytes(bytes(data))
    code = (
        f"from dflash_cache.data.readers import read_records\nfrom dflash_cache import DFlashCacheError\n"
        f"try:\n    list(read_records({str(path)!r}))\nexcept DFlashCacheError as e:\n    print(e)\n    raise SystemExit(1)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr[-500:])
    assert result.stdout.startswith(
        f"{path}: unreadable data part-way through the file (In column 0: Invalid: List child array invalid"
    )


DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON nested past Python's recursion limit


def test_json_nested_100000_deep_is_named_as_the_file_it_is(tmp_path):
    """A manifest, a journal line, a checkpoint's drafter config and training state, a run's run.json: `json` raised a bare
    `RecursionError: maximum recursion depth exceeded while decoding a JSON array` naming no file."""
    from dflash_cache.drafter.checkpoint import CONFIG_FILE, save_drafter
    from dflash_cache.drafter.config_file import load_drafter_config
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
    assert (
        code == 1
        and err.count("\n") == 1
        and f"{tmp_path / 'checkpoint' / CONFIG_FILE}: unreadable (maximum recursion" in err
    ), err

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(DEEP)
    code, err = cli(
        "train",
        "--cache",
        cache,
        "--out",
        run,
        "--drafter",
        drafter,
        "--steps",
        2,
        "--token-budget",
        128,
        "--max-anchors",
        8,
        "--resume",
    )
    assert (
        code == 1 and err.count("\n") == 1 and f"--resume: {run / 'run.json'} is unreadable (maximum recursion" in err
    ), err

    from safetensors.torch import save_file

    from dflash_cache.train.state_io import load_state

    save_file({}, tmp_path / "checkpoint" / "train_state.safetensors")
    (tmp_path / "checkpoint" / "train_state.json").write_text(DEEP)
    with pytest.raises(DFlashCacheError, match=r"checkpoint: unreadable training state \(maximum recursion"):
        load_state(tmp_path / "checkpoint", "train_state")

    (cache / "manifest.json").write_text(DEEP)
    for command in ("inspect", "verify"):
        code, err = cli(command, cache)
        assert code == 1 and err.count("\n") == 1 and "manifest.json: unreadable manifest (maximum recursion" in err, (
            err
        )


# Reads the tokenized data in a process of its own (a crash is then a return code); no tokenizer is
# given, as nothing is to be tokenized: a file found damaged is an error, not made again.
TOKENIZED = """
import sys
from dflash_cache import DFlashCacheError
from transformers import AutoTokenizer
from dflash_cache.data.tokenized import tokenized_data
try:
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[3])  # the ids are checked against its vocabulary
    data = tokenized_data([sys.argv[1]], tokenizer, 64, "t" * 64, sys.argv[2], workers=0)
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
    import zlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_cache.data.tokenized import tokenized_data

    data, folder = tmp_path / "tokens.parquet", tmp_path / "tok"
    pq.write_table(pa.table({"input_ids": [list(range(100, 140)), list(range(200, 207))]}), data)
    arrow = tokenized_data([data], tokenizer, 64, "t" * 64, folder, workers=0).path
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    run = lambda: subprocess.run(
        [sys.executable, "-c", TOKENIZED, str(data), str(folder), str(tmp_path / "tokenizer")],  # noqa: E731
        capture_output=True,
        text=True,
        timeout=120,
    )
    read = run()  # the file as written reads back in the other process
    assert read.returncode == 0 and read.stdout.strip() == str([list(range(100, 140)), list(range(200, 207))]), read
    raw = bytearray(arrow.read_bytes())
    if lie == "values":
        node = raw.find(struct.pack("<qq", 47, 0))  # the input_ids values' field node: 47 entries, no nulls
        assert node > 0
        raw[node : node + 8] = struct.pack("<q", 1 << 40)
        arrow.with_suffix(".index.npy").unlink()  # indexed again from the crafted file
    else:  # the batch's length and its columns' field nodes: no other int64 in the file is 2
        places = [i for i in range(len(raw) - 8) if raw[i : i + 8] == struct.pack("<q", 2)]
        assert len(places) >= 5
        for i in places:
            raw[i : i + 8] = struct.pack("<q", 1 << 20)
    info = arrow.with_suffix(".json")  # it vouches for the crafted file: its rows and its CRC-32
    rows = {} if lie == "values" else {"rows": 1 << 20}
    info.write_text(json.dumps({**json.loads(info.read_text()), **rows, "crc32": zlib.crc32(raw)}))
    arrow.write_bytes(bytes(raw))
    result = run()
    assert result.returncode == 1, (result.returncode, result.stderr[-500:])
    assert (
        result.stdout.startswith(f"{arrow}: unreadable data part-way through the file (")
        and result.stdout.count("\n") == 1
    ), result.stdout
    assert result.stdout.rstrip().endswith("; delete it and rerun to tokenize the data again"), result.stdout
    assert arrow.read_bytes() == raw  # not silently made again
