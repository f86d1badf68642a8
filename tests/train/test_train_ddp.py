"""Two CPU processes over gloo, through the same spawn path as one process per GPU."""

import multiprocessing
import time

import pytest

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.train.train import train
from tests.support.train import losses, make_cache, tiny_train_config


@pytest.mark.slow
def test_two_ranks_give_the_losses_of_one_with_the_same_global_batch(tmp_path):
    cache = make_cache(tmp_path / "cache")
    train(tiny_train_config(tmp_path, cache, out="one", steps=3, grad_accum=2), echo=print)
    train(tiny_train_config(tmp_path, cache, out="two", steps=3, cpu_procs=2), echo=print)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == 3 and two == pytest.approx(one, rel=1e-5)


@pytest.mark.slow
def test_a_failing_rank_stops_every_rank(tmp_path):
    cache = make_cache(tmp_path / "cache", codec="bf16")
    shard = cache / open_cache(cache).shards[1].path
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a row's raw hidden bytes: its checksum fails
    shard.write_bytes(bytes(data))
    start = time.monotonic()
    with pytest.raises(DFlashCacheError, match=r"rank \d: reading sample \d+: .*(checksum|sha256 does not match)"):
        train(tiny_train_config(tmp_path, cache, epochs=1, cpu_procs=2), echo=print)
    assert time.monotonic() - start < 60  # includes starting two interpreters
    assert not multiprocessing.active_children()
