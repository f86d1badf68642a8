import json
import random

import numpy as np
import pytest
import torch

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.store.codecs import CODECS, SUBSPACE_CODECS, compress, decode, decompress, encode, encoded_size
from dflash_cache.store.manifest import build_manifest, manifest_checksum, read_journals, write_manifest
from dflash_cache.store.reader import ShardReader
from dflash_cache.store.shard import file_sha256
from dflash_cache.store.verify import verify_cache
from dflash_cache.store.writer import ShardWriter
from tests.support.cachegen import random_row, random_spec, write_random_cache


def roundtrip(x: torch.Tensor, codec: str, layers: int) -> torch.Tensor:
    enc = encode(x, codec, layers)
    data = compress(enc.planes.numpy(), codec)
    planes = decompress(data, codec, encoded_size(codec, *x.shape))
    return decode(torch.from_numpy(planes.copy()), enc.scales, codec, *x.shape)


def activations_with_outliers(tokens=64, layers=3, hidden=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layers, hidden, generator=g)
    x[:, :, torch.randperm(hidden, generator=g)[:6]] *= 100.0  # a few massive channels, as in real LLMs
    x[:, :, 0] += 30.0
    return x.reshape(tokens, -1).bfloat16()


@pytest.mark.parametrize("codec", ["bf16", "bf16-zstd"])
def test_lossless_codecs_are_bit_exact(codec):
    x = activations_with_outliers()
    x[0, :5] = torch.tensor([float("inf"), -0.0, 1e-40, -3.5, 65504.0])
    y = roundtrip(x, codec, 3)
    assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_fp8_relative_error_within_3_percent_with_outliers():
    x = activations_with_outliers(seed=1)
    y = roundtrip(x, "fp8-zstd", 3)
    err = ((x.float() - y.float()).norm() / x.float().norm()).item()
    assert 0 < err <= 0.03
    # per-token-per-layer scales keep quiet tokens as accurate as loud ones
    x[:10] *= 1e-3
    y = roundtrip(x, "fp8-zstd", 3)
    quiet = ((x[:10].float() - y[:10].float()).norm() / x[:10].float().norm()).item()
    assert quiet <= 0.03


def test_bf16_zstd_high_byte_plane_comes_first():
    x = torch.tensor([[1.0, -2.0]], dtype=torch.bfloat16)
    planes = encode(x, "bf16-zstd", 1).planes
    raw = x.view(torch.uint8).reshape(-1, 2)
    assert planes.tolist() == raw[:, 1].tolist() + raw[:, 0].tolist()


@pytest.mark.parametrize("codec", [c for c in CODECS if c not in SUBSPACE_CODECS])  # those: test_subspace
def test_cache_roundtrip_random_access(tmp_path, codec):
    spec = random_spec(codec=codec)
    lengths = [5, 17, 1, 33, 8, 12, 3]
    written = write_random_cache(tmp_path, lengths, spec, rows_per_shard=3)
    cache = open_cache(tmp_path)
    assert len(cache) == len(lengths) and sorted(cache) == list(range(len(lengths)))
    assert cache.lengths() == dict(enumerate(lengths))
    for sid in [6, 0, 3]:
        sample = cache[sid]
        assert sample.hidden.shape == (lengths[sid], 64) and sample.hidden.dtype == torch.bfloat16
        if codec in ("bf16", "bf16-zstd"):  # the lossless ones
            assert torch.equal(sample.hidden, written[sid])
        row, _ = random_row(sid, lengths[sid], spec)
        assert sample.input_ids.tolist() == row.input_ids.tolist()
        assert sample.loss_mask.tolist() == row.loss_mask.tolist()
    assert cache.manifest["totals"]["tokens"] == sum(lengths)
    assert verify_cache(cache).rows == len(lengths)


def test_manifest_merge_is_idempotent(tmp_path):
    write_random_cache(tmp_path, [4, 5, 6, 7, 8])
    first = (tmp_path / "manifest.json").read_text()
    write_manifest(tmp_path, build_manifest(read_journals(tmp_path)))
    assert (tmp_path / "manifest.json").read_text() == first


def test_uncommitted_shard_is_never_listed(tmp_path):
    spec = random_spec()
    writer = ShardWriter(tmp_path, rank=0, spec=spec)
    writer.append(random_row(0, 4, spec)[0])
    writer.commit()
    writer.append(random_row(1, 4, spec)[0])  # left open: a crash before commit
    state = read_journals(tmp_path)
    assert [s.sample_ids for s in state.shards] == [[0]]
    writer.abort()
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["r0-00000.arrow"]


def test_shard_hash_followed_while_writing_equals_the_files(tmp_path, monkeypatch):
    """The sha256 a shard is journaled with is hashed while the shard is written (and synced every
    SYNC_EVERY bytes); it must equal the hash of the finished file, for shards closed full and last."""
    from dflash_cache.store import writer as writer_module

    monkeypatch.setattr(writer_module._Sealer, "SYNC_EVERY", 4096)
    spec = random_spec()
    writer = ShardWriter(tmp_path, rank=0, spec=spec, max_shard_bytes=40_000)
    for i in range(12):
        writer.append(random_row(i, 300, spec)[0])
    writer.commit()
    shards = read_journals(tmp_path).shards
    assert len(shards) > 2
    for record in shards:
        assert record.sha256 == file_sha256(tmp_path / record.path)
    assert sorted(i for record in shards for i in record.sample_ids) == list(range(12))


def test_verify_fails_on_flipped_bytes(tmp_path):
    write_random_cache(tmp_path, [20, 30, 40], rows_per_shard=8)
    shard = tmp_path / "shards" / "r0-00000.arrow"
    original = shard.read_bytes()
    rng = random.Random(0)
    for offset in rng.sample(range(len(original)), 25):
        data = bytearray(original)
        data[offset] ^= 1 << rng.randrange(8)
        shard.write_bytes(bytes(data))
        with pytest.raises(DFlashCacheError, match="r0-00000.arrow"):
            verify_cache(open_cache(tmp_path))
    shard.write_bytes(original)
    verify_cache(open_cache(tmp_path))


def test_row_checksum_catches_flips_even_with_a_matching_sha(tmp_path):
    """A flipped byte inside a row, with the manifest's sha256 updated to match, still fails."""
    write_random_cache(tmp_path, [20, 30], rows_per_shard=8)
    shard = tmp_path / "shards" / "r0-00000.arrow"
    data = bytearray(shard.read_bytes())
    cache = open_cache(tmp_path)
    hidden = bytes(cache.read_stored(1).hidden)
    at = bytes(data).index(hidden[:64]) + 10
    data[at] ^= 0xFF
    shard.write_bytes(bytes(data))
    import hashlib

    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["shards"][0]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    manifest["checksum"] = manifest_checksum(manifest)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DFlashCacheError, match=r"row 1 \(sample 1\)"):
        verify_cache(open_cache(tmp_path))
    with pytest.raises(DFlashCacheError, match="checksum"):
        open_cache(tmp_path)[1]


@pytest.mark.parametrize("field", ["input_ids", "target_ids", "hidden", "hidden_scales"])
def test_row_checksum_covers_every_field(tmp_path, field):
    write_random_cache(tmp_path, [40], random_spec(codec="fp8-zstd"))
    shard = tmp_path / "shards" / "r0-00000.arrow"
    value = bytes(memoryview(getattr(open_cache(tmp_path).read_stored(0), field)).cast("B"))
    data = bytearray(shard.read_bytes())
    data[bytes(data).index(value) + len(value) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(DFlashCacheError, match=r"row 0 \(sample 0\) fails its checksum"):
        open_cache(tmp_path).read_stored(0)


def test_reader_hands_out_the_payload_without_copying_it(tmp_path):
    """A copy of a row's payload would be made with the GIL held, stalling the training thread."""
    write_random_cache(tmp_path, [40, 50], random_spec(codec="fp8-zstd"))
    path = tmp_path / "shards" / "r0-00000.arrow"
    reader = ShardReader(path)
    reader._source.seek(0)
    mapped = reader._source.read_buffer(1).address
    row = reader.row(1)
    for view in (row.hidden, row.hidden_scales):
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data
        assert mapped <= address and address + len(view) <= mapped + path.stat().st_size


def test_verify_fails_on_truncation_and_missing_shard(tmp_path):
    write_random_cache(tmp_path, [20, 30, 40, 10, 11], rows_per_shard=3)
    shard = tmp_path / "shards" / "r0-00001.arrow"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(DFlashCacheError, match="r0-00001.arrow.*truncated"):
        verify_cache(open_cache(tmp_path))
    shard.unlink()
    with pytest.raises(DFlashCacheError, match="r0-00001.arrow.*missing"):
        verify_cache(open_cache(tmp_path))


def test_bad_manifests(tmp_path):
    with pytest.raises(DFlashCacheError, match="no such cache"):
        open_cache(tmp_path / "nope")
    with pytest.raises(DFlashCacheError, match="is not a cache"):  # an empty folder: no extraction ran there
        open_cache(tmp_path)
    write_random_cache(tmp_path, [4, 5])
    path = tmp_path / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(DFlashCacheError, match="newer"):
        open_cache(tmp_path)
    manifest["shards"][0]["rows"] = 7
    path.write_text(json.dumps(manifest))
    with pytest.raises(DFlashCacheError, match="malformed"):
        open_cache(tmp_path)
    path.write_text("{not json")
    with pytest.raises(DFlashCacheError, match="unreadable"):
        open_cache(tmp_path)
