"""Write small caches of random rows straight through the store, for tests of the readers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash_cache.store.codecs import compress, encode
from dflash_cache.store.manifest import build_manifest, read_journals, write_manifest
from dflash_cache.store.schema import Row
from dflash_cache.store.writer import ShardWriter


def random_spec(
    codec: str = "bf16-zstd", layer_ids=(1, 3), hidden_size: int = 32, vocab_size: int = 100, topk: int = 0
) -> dict:
    return {
        "target": {
            "name": "random",
            "model_type": "qwen3",
            "config_hash": "0" * 64,
            "num_layers": 6,
            "hidden_size": hidden_size,
            "vocab_size": vocab_size,
        },
        "layer_ids": list(layer_ids),
        "codec": codec,
        "hidden_dtype": "bfloat16",
        "tokenizer_hash": "0" * 64,
        "data_hash": "0" * 64,
        "max_length": 4096,
        "topk": topk,
    }


def random_row(sample_id: int, num_tokens: int, spec: dict, seed: int = 0) -> tuple[Row, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100003 + sample_id)
    vocab = spec["target"]["vocab_size"]
    layers = len(spec["layer_ids"])
    hidden = torch.randn(num_tokens, layers * spec["target"]["hidden_size"], generator=g).bfloat16()
    enc = encode(hidden, spec["codec"], layers)
    row = Row(
        sample_id=sample_id,
        input_ids=torch.randint(0, vocab, (num_tokens,), generator=g).numpy().astype(np.int32),
        loss_mask=(torch.rand(num_tokens, generator=g) > 0.3).numpy(),
        target_ids=torch.randint(0, vocab, (num_tokens,), generator=g).numpy().astype(np.int32),
        hidden=compress(enc.planes.numpy(), spec["codec"]),
        hidden_scales=None if enc.scales is None else enc.scales.numpy().tobytes(),
    )
    if k := spec["topk"]:  # K distinct ids a token, with log-probabilities in decreasing order
        row.topk_ids = torch.rand(num_tokens, vocab, generator=g).argsort(1)[:, :k].numpy().astype(np.int32)
        logits = torch.randn(num_tokens, vocab, generator=g)
        row.topk_logprobs = logits.log_softmax(1).sort(1, descending=True).values[:, :k].numpy()
    return row, hidden


def write_random_cache(
    root: Path,
    lengths: list[int],
    spec: dict | None = None,
    rows_per_shard: int = 4,
    seed: int = 0,
    record_ids: list[str | None] | None = None,
) -> dict[int, torch.Tensor]:
    """Writes a complete cache (rank 0, sample ids 0..n-1, sample i with `record_ids[i]`); returns the
    hidden tensors written."""
    spec = spec or random_spec()
    writer = ShardWriter(root, rank=0, spec=spec)
    hidden = {}
    for sid, n in enumerate(lengths):
        row, hidden[sid] = random_row(sid, n, spec, seed)
        row.record_id = None if record_ids is None else record_ids[sid]
        writer.append(row)
        if (sid + 1) % rows_per_shard == 0:
            writer.commit()
    writer.commit()
    write_manifest(root, build_manifest(read_journals(root)))
    return hidden


def write_one_row_shards(root: Path, lengths: list[int], spec: dict, distinct: int = 8) -> None:
    """A complete cache of one row per shard (sample ids 0..n-1), written straight as Arrow files with
    no fsync: many shards fast. Rows reuse `distinct` random payloads, each under its own sample id."""
    from dataclasses import replace

    import pyarrow as pa

    from dflash_cache.store.manifest import JournalState
    from dflash_cache.store.schema import ROW_SCHEMA
    from dflash_cache.store.shard import SHARD_DIR, ShardRecord, file_sha256, shard_name

    (root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    templates: dict[int, Row] = {}
    records = []
    for sid, n in enumerate(lengths):
        key = (sid % distinct, n)
        if key not in templates:
            templates[key] = random_row(sid, n, spec)[0]
        row = replace(templates[key], sample_id=sid)
        rel = f"{SHARD_DIR}/{shard_name(0, sid)}"
        with pa.OSFile(str(root / rel), "wb") as sink, pa.ipc.new_file(sink, ROW_SCHEMA) as writer:
            writer.write_batch(row.record_batch)
        size = (root / rel).stat().st_size
        records.append(
            ShardRecord(
                path=rel,
                rows=1,
                tokens=n,
                bytes=size,
                hidden_bytes=len(row.hidden),
                sha256=file_sha256(root / rel),
                sample_ids=[sid],
                num_tokens=[n],
            )
        )
    write_manifest(root, build_manifest(JournalState(spec, records, [])))
