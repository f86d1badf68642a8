"""The extraction fast path against a plain synchronous reference (on a GPU; on the CPU the same code
runs with plain copies).

The worker never waits for the GPU: copies run on a side stream into a few reused host slots while
later forwards are already queued. A missing wait or a slot reused too early would store another
batch's values, so every stored tensor must equal, bit for bit, what the same runner returns for the
same batch when everything is synchronous.
"""

import numpy as np
import pytest
import torch

from dflash_cache import open_cache
from dflash_cache.data.dataset import Sample
from dflash_cache.extract.buckets import BucketLayout
from dflash_cache.extract.packing import PackedLayout
from dflash_cache.extract.worker import RankJob, run_rank
from dflash_cache.store.manifest import build_manifest, read_journals, write_manifest
from dflash_cache.store.verify import verify_cache
from dflash_cache.target.runner import TargetRunner
from dflash_cache.target.target import load_target

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"  # the CPU run checks the test itself
LAYERS = [1, 4]


def _samples(vocab: int, count: int = 40) -> dict[int, Sample]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, 300, count)
    return {
        i: Sample(i, rng.integers(0, vocab, n).astype(np.int32), np.ones(n, dtype=bool)) for i, n in enumerate(lengths)
    }


@pytest.mark.parametrize("layout", [PackedLayout(900), BucketLayout(900, 300)], ids=["packed", "padded"])
@pytest.mark.parametrize("codec", ["bf16-zstd", "fp8-zstd"])
def test_async_extraction_equals_synchronous_runner(target_dir, tmp_path, codec, layout):
    target = load_target(target_dir, DEVICE, attention=layout.attention)
    samples = _samples(target.vocab_size)
    batches = layout.plan(list(samples), [len(s.input_ids) for s in samples.values()])
    spec = {
        "target": {
            "config_hash": target.config_hash,
            "num_layers": target.num_layers,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "model_type": target.config.model_type,
            "name": "tiny",
        },
        "layer_ids": LAYERS,
        "codec": codec,
        "hidden_dtype": "bfloat16",
        "tokenizer_hash": "",
        "data_hash": "",
        "max_length": 8192,
        "topk": 2,
    }
    job = RankJob(
        root=tmp_path / "cache",
        target_path=target_dir,
        device=DEVICE,
        rank=0,
        spec=spec,
        layout=layout,
        batches=batches,
        samples=samples,
        done=set(),
        first_shard_index=0,
        compress_threads=3,
        staging_slots=2,
        queue_depth=2,
    )
    run_rank(job, target=target)
    write_manifest(job.root, build_manifest(read_journals(job.root)))
    cache = open_cache(job.root)

    runner = TargetRunner(target, LAYERS, topk=2)
    reference = {}
    for batch in batches:
        fb = layout.build([samples[i] for i in batch], DEVICE)
        out = runner.run_batch(fb)
        for sid, row, start, n in zip(batch, fb.rows.tolist(), fb.starts.tolist(), fb.lengths.tolist()):
            at = slice(start, start + n)
            reference[sid] = (out.hidden[row, at].cpu(), out.target_ids[row, at].cpu(), out.topk_ids[row, at].cpu())
    assert sorted(cache) == sorted(samples)
    for sid, (hidden, target_ids, topk_ids) in reference.items():
        stored = cache[sid]
        if codec == "bf16-zstd":
            assert torch.equal(stored.hidden.view(torch.int16), hidden.view(torch.int16)), sid
        else:
            torch.testing.assert_close(stored.hidden.float(), hidden.float(), atol=0.1, rtol=0.07)
        assert torch.equal(stored.target_ids.long(), target_ids), sid
        assert torch.equal(stored.topk_ids.long(), topk_ids), sid
    verify_cache(cache)
