import threading
import time

import numpy as np
import pytest
import torch

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.data.plan import plan_batches
from dflash_cache.store.manifest import build_manifest, read_journals, write_manifest
from dflash_cache.store.writer import ShardWriter
from dflash_cache.stream.caches import CacheSet, is_held_out
from dflash_cache.stream.epochs import EpochPlan
from dflash_cache.stream.loader import Loader, ReaderError, empty_host_batch
from dflash_cache.stream.memory import MemorySource
from tests.support.cachegen import random_row, random_spec, write_random_cache

LENGTHS = [7, 30, 1, 18, 44, 9, 25, 13, 3, 36, 21, 16]


def cache_at(root, lengths=LENGTHS, codec="bf16-zstd", seed=0, **spec):
    spec = random_spec(codec=codec, **spec)
    write_random_cache(root, lengths, spec, rows_per_shard=5, seed=seed)
    return root


def expected(caches: CacheSet, keys: list[int]) -> dict:
    """The batch built sample by sample through the store's own reader."""
    samples = []
    for key in keys:
        c, sid = caches.entries[key]
        samples.append(caches.caches[c][sid])
    return {
        "input_ids": torch.cat([s.input_ids for s in samples]),
        "loss_mask": torch.cat([s.loss_mask for s in samples]),
        "target_ids": torch.cat([s.target_ids for s in samples]),
        "hidden": torch.cat([s.hidden for s in samples]),
    }


@pytest.mark.parametrize("codec", ["bf16", "bf16-zstd", "fp8-zstd", "fp4", "fp4-zstd"])
def test_loader_packs_batches_exactly_as_the_store_reads_them(tmp_path, codec):
    caches = CacheSet([cache_at(tmp_path / "c", codec=codec)])
    batches = plan_batches(list(range(len(caches))), caches.lengths, 50, seed=3)
    with Loader(caches, batches, "cpu", prefetch=2, workers=3) as loader:
        got = list(loader)
    assert len(got) == len(batches)
    for keys, batch in zip(batches, got):
        want = expected(caches, keys)
        assert batch.sample_ids == [caches.sample_id(k) for k in keys]
        assert batch.num_tokens == sum(caches.lengths[k] for k in keys)  # packed: no padding
        assert batch.cu_seqlens.tolist() == [0, *torch.tensor([caches.lengths[k] for k in keys]).cumsum(0).tolist()]
        for name, value in want.items():
            assert torch.equal(
                getattr(batch, name).view(torch.uint8) if name == "hidden" else getattr(batch, name),
                value.view(torch.uint8) if name == "hidden" else value,
            ), name
        assert batch.hidden.dtype == torch.bfloat16


def test_loader_reads_top_k_labels_when_asked(tmp_path):
    """`topk`: each batch carries the cache's top-K ids and log-probabilities, packed as the tokens are;
    without it, none (no memory spent on them)."""
    caches = CacheSet([cache_at(tmp_path / "c", topk=3)])
    batches = plan_batches(list(range(len(caches))), caches.lengths, 50, seed=3)
    with Loader(caches, batches, "cpu", prefetch=2, workers=3, topk=True) as loader:
        got = list(loader)
    for keys, batch in zip(batches, got):
        samples = [caches.caches[0][caches.sample_id(k)] for k in keys]
        assert batch.topk_ids.shape == (batch.num_tokens, 3) and batch.topk_ids.dtype == torch.int64
        assert torch.equal(batch.topk_ids, torch.cat([s.topk_ids for s in samples]))
        assert torch.equal(batch.topk_logprobs, torch.cat([s.topk_logprobs for s in samples]))
    with Loader(caches, batches[:1], "cpu") as loader:
        assert next(loader).topk_ids is None


def test_host_buffers_have_one_size_for_the_whole_run(tmp_path):
    """Every batch's planes sit in a buffer sized for the largest batch, so pinned blocks are reused."""
    caches = CacheSet([cache_at(tmp_path / "c")])
    batches = plan_batches(list(range(len(caches))), caches.lengths, 50, seed=3)
    largest = max(sum(caches.lengths[k] for k in keys) for keys in batches)
    sizes = {
        empty_host_batch(caches, keys, pin=False, capacity_tokens=largest).planes.untyped_storage().nbytes()
        for keys in batches
    }
    assert sizes == {2 * largest * caches.width}  # bf16-zstd: two planes of one byte per value


def test_reader_error_reaches_the_consumer_promptly(tmp_path, monkeypatch):
    caches = CacheSet([cache_at(tmp_path / "c")])
    batches = [[k] for k in range(len(caches))]
    real_read = CacheSet.read

    def read(self, key):
        if key == 5:
            raise OSError("injected read failure")
        if key > 5:
            time.sleep(3)  # later rows are slow: the error must not wait for them
        return real_read(self, key)

    monkeypatch.setattr(CacheSet, "read", read)
    start = time.monotonic()
    with (
        pytest.raises(ReaderError, match="sample 5: OSError: injected read failure"),
        Loader(caches, batches, "cpu", prefetch=8, workers=4) as loader,
    ):
        for _ in loader:
            pass
    assert time.monotonic() - start < 2


def test_corrupt_row_names_the_sample(tmp_path):
    root = cache_at(tmp_path / "c")
    shard = root / open_cache(root).shards[0].path
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    caches = CacheSet([root])
    with (
        pytest.raises(DFlashCacheError, match="reading sample"),
        Loader(caches, [[k] for k in range(len(caches))], "cpu") as loader,
    ):
        list(loader)


@pytest.mark.parametrize("name, bad", [("target_ids", 100), ("input_ids", -1), ("topk_ids", 100)])
def test_token_ids_outside_the_vocabulary_name_the_sample(tmp_path, name, bad):
    """Rows that pass their checksums but hold an id the target's vocabulary (100) lacks: the GPU loss
    kernel would read past a row of logits, so the loader stops, naming the sample. Top-K ids are
    checked when the batches read them."""
    root, spec = tmp_path / "c", random_spec(vocab_size=100, topk=2 if name == "topk_ids" else 0)
    writer = ShardWriter(root, rank=0, spec=spec)
    for sid in range(3):
        row, _ = random_row(sid, 12, spec)
        if sid == 1:
            getattr(row, name).reshape(-1)[5] = bad
        writer.append(row)
    writer.commit()
    write_manifest(root, build_manifest(read_journals(root)))
    caches = CacheSet([root])
    with (
        pytest.raises(
            DFlashCacheError,
            match=f"reading sample 1: {name} holds token id {bad}, outside the target's vocabulary of 100",
        ),
        Loader(caches, [[k] for k in range(len(caches))], "cpu", topk=name == "topk_ids") as loader,
    ):
        list(loader)


def test_prefetch_bounds_the_batches_read_ahead(tmp_path, monkeypatch):
    caches = CacheSet([cache_at(tmp_path / "c")])
    read_keys = []
    lock = threading.Lock()
    real_read = CacheSet.read

    def read(self, key):
        with lock:
            read_keys.append(key)
        return real_read(self, key)

    monkeypatch.setattr(CacheSet, "read", read)
    batches = [[k] for k in range(len(caches))]
    with Loader(caches, batches, "cpu", prefetch=3, workers=4) as loader:
        time.sleep(0.5)
        assert sorted(read_keys) == [0, 1, 2]
        next(loader)
        time.sleep(0.5)
        assert sorted(read_keys) == [0, 1, 2, 3]


def test_union_of_one_data_source_needs_disjoint_ids(tmp_path):
    a = cache_at(tmp_path / "a", LENGTHS[:5])
    b = cache_at(tmp_path / "b", LENGTHS[5:], seed=1)
    spec_b = open_cache(b).spec
    assert spec_b["data_hash"] == open_cache(a).spec["data_hash"]
    with pytest.raises(DFlashCacheError, match="sample 0 is in both"):
        CacheSet([a, b])  # one data source, overlapping sample ids


def test_union_of_caches_from_different_data(tmp_path):
    a = cache_at(tmp_path / "a", LENGTHS[:5])
    spec = random_spec()
    spec["data_hash"] = "1" * 64
    b = tmp_path / "b"
    write_random_cache(b, LENGTHS[5:], spec, seed=1)
    caches = CacheSet([a, b])
    assert len(caches) == len(LENGTHS)
    assert caches.lengths == LENGTHS
    assert caches.describe(7) == f"sample 2 of {b}"
    with Loader(caches, [[4, 5, 6]], "cpu") as loader:
        batch = next(loader)
    assert batch.sample_ids == [4, 0, 1]
    assert torch.equal(batch.hidden, expected(caches, [4, 5, 6])["hidden"])


def test_caches_batched_differently_train_together(tmp_path):
    """Extractions that differ in --token-budget (and so in their packed rows or padded buckets) hold
    the same kind of rows: FORMAT.md says they can be trained on together."""
    a, b = random_spec(), random_spec()
    a.update(token_budget=49152, batching={"layout": "PackedLayout", "row_tokens": 49152})
    b.update(
        token_budget=4096,
        batching={"layout": "BucketLayout", "token_budget": 4096, "max_length": 4096},
        data_hash="1" * 64,
    )
    write_random_cache(tmp_path / "a", LENGTHS[:5], a)
    write_random_cache(tmp_path / "b", LENGTHS[5:], b, seed=1)
    assert len(CacheSet([tmp_path / "a", tmp_path / "b"])) == len(LENGTHS)


def test_union_needs_the_same_spec(tmp_path):
    a = cache_at(tmp_path / "a")
    b = cache_at(tmp_path / "b", layer_ids=(1, 4), codec="fp8-zstd")
    with pytest.raises(
        DFlashCacheError, match=r"different specs \(codec: bf16-zstd -> fp8-zstd; layer_ids: \[1, 3\] -> \[1, 4\]\)"
    ):
        CacheSet([a, b])


def test_not_a_cache_and_incomplete_cache(tmp_path):
    with pytest.raises(DFlashCacheError, match="no such cache directory"):
        CacheSet([tmp_path / "missing"])
    root = cache_at(tmp_path / "c")
    (root / "manifest.json").unlink()
    with pytest.raises(DFlashCacheError, match="incomplete"):
        CacheSet([root])


def test_held_out_split_is_stable_and_by_sample_id(tmp_path):
    ids = range(20000)
    chosen = [i for i in ids if is_held_out(i, 0.05)]
    assert 0.04 < len(chosen) / 20000 < 0.06
    assert chosen == [i for i in ids if is_held_out(i, 0.05)]
    assert {i for i in ids if is_held_out(i, 0.01)} <= set(chosen)  # a larger fraction keeps the smaller's
    caches = CacheSet([cache_at(tmp_path / "c")])
    train, held = caches.split(0.3)
    assert sorted(train + held) == list(range(len(caches)))
    assert held == [k for k in range(len(caches)) if is_held_out(caches.sample_id(k), 0.3)]
    assert caches.split(0.0) == (list(range(len(caches))), [])


def test_epoch_plan_is_the_same_for_any_world_size():
    lengths = [(i * 37) % 90 + 5 for i in range(200)]
    keys = list(range(200))
    one = EpochPlan(keys, lengths, 256, seed=1, world=1, grad_accum=4)
    four = EpochPlan(keys, lengths, 256, seed=1, world=4, grad_accum=1)
    assert one.batches(0) == four.batches(0)
    assert one.batches(0) != one.batches(1)
    steps = one.steps_in_epoch(0)
    assert steps == four.steps_in_epoch(0) == len(one.batches(0)) // 4
    for s in range(steps):  # step s trains on the same plan positions either way
        single = {one.global_index(s * 4 + i, 0) for i in range(4)}
        spread = {four.global_index(s, r) for r in range(4)}
        assert single == spread == set(range(4 * s, 4 * s + 4))
    shares = [four.rank_batches(0, r) for r in range(4)]
    assert all(len(s) == steps for s in shares)
    assert one.total_steps(epochs=2, steps=None) == steps + one.steps_in_epoch(1)


def test_memory_source_cycles_device_batches(tmp_path):
    caches = CacheSet([cache_at(tmp_path / "c")])
    with Loader(caches, [[0, 1], [2, 3]], "cpu") as loader:
        batches = list(loader)
    source = MemorySource(batches, length=5)
    assert len(source) == 5
    assert [b.sample_ids for b in source] == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["bf16-zstd", "fp8-zstd", "fp4-zstd"])
def test_gpu_loader_equals_cpu_loader(tmp_path, codec):
    caches = CacheSet([cache_at(tmp_path / "c", codec=codec)])
    batches = plan_batches(list(range(len(caches))), caches.lengths, 60, seed=0)
    with Loader(caches, batches, "cpu") as cpu, Loader(caches, batches, "cuda", prefetch=3) as gpu:
        for a, b in zip(cpu, gpu):
            assert b.hidden.is_cuda and b.input_ids.is_cuda
            torch.cuda.synchronize()
            assert torch.equal(a.hidden.view(torch.int16), b.hidden.cpu().view(torch.int16))
            assert torch.equal(a.input_ids, b.input_ids.cpu()) and torch.equal(a.cu_seqlens, b.cu_seqlens.cpu())


@pytest.mark.parametrize("codec", ["bf16", "bf16-zstd", "fp8-zstd", "fp4", "fp4-zstd"])
def test_decompress_into_matches_the_store(codec):
    from dflash_cache.store.codecs import compress, decompress, decompress_into, encode, encoded_size, plane_layout

    x = torch.randn(37, 3 * 16).bfloat16()
    payload = compress(encode(x, codec, 3).planes.numpy(), codec)
    size = encoded_size(codec, *x.shape)
    num_planes = plane_layout(codec, x.shape[1])[0]
    out = np.zeros((num_planes, size // num_planes), dtype=np.uint8)
    decompress_into(memoryview(payload), codec, out)
    assert np.array_equal(out.reshape(-1), decompress(payload, codec, size))
    with pytest.raises(DFlashCacheError, match="corrupt"):
        decompress_into(memoryview(payload[:-5]), codec, out)
