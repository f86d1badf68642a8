"""FORMAT.md is enough to read a cache: a reader written from it alone (tests/support/format_reader.py:
numpy, pyarrow and zstandard, nothing of dflash_cache) decodes a cache that `extract` wrote, for every
codec, into the token ids, loss masks and record ids this test wrote and the hidden states and argmax
of the target's own forward computed here; and agrees with the reference reader bit for bit."""

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_cache import open_cache
from dflash_cache.target.precision import forward_dtype
from tests.support import format_reader
from tests.support.extract import SHARD_BYTES, run_extract

READER_IMPORTS = {"hashlib", "json", "zlib", "dataclasses", "pathlib", "numpy", "pyarrow", "zstandard"}
LENGTHS = [37, 5, 120, 64, 18, 90, 9, 51]


def test_the_reader_imports_only_the_format_libraries():
    tree = ast.parse(Path(format_reader.__file__).read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= READER_IMPORTS, imported - READER_IMPORTS


@pytest.fixture(scope="module")
def written(qwen3_target_dir, tmp_path_factory):
    """Pre-tokenized records with random token ids, random loss masks (at least one trained-on token)
    and record ids on every other record: what the cache must give back."""
    vocab = json.loads((qwen3_target_dir / "config.json").read_text())["vocab_size"]
    g = np.random.default_rng(7)
    records = []
    for i, n in enumerate(LENGTHS):
        mask = g.random(n) < 0.6
        mask[n // 2] = True
        record = {"input_ids": g.integers(0, vocab, n).tolist(), "loss_mask": mask.tolist()}
        if i % 2 == 0:
            record["id"] = f"rec-{i}"
        records.append(record)
    path = tmp_path_factory.mktemp("data") / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, records


@pytest.fixture(scope="module")
def forward(qwen3_target_dir):
    """The target's hidden states and logits of a sequence run alone, in the dtype extraction runs it in."""
    model = AutoModelForCausalLM.from_pretrained(qwen3_target_dir, dtype=forward_dtype("cpu")).eval()

    @torch.no_grad()
    def run(ids: list[int], layers: list[int]) -> tuple[np.ndarray, np.ndarray]:
        out = model(torch.tensor([ids]), output_hidden_states=True)
        hidden = torch.cat([out.hidden_states[i + 1][0] for i in layers], dim=-1)
        return hidden.float().numpy(), out.logits[0].float().numpy()

    return model, run


@pytest.fixture(scope="module", params=["bf16", "bf16-zstd", "fp8-zstd", "fp4", "fp4-zstd"])
def extracted(request, qwen3_target_dir, written, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "cache"
    run_extract(
        qwen3_target_dir, written[0], out, codec=request.param, topk=2, tokenize_workers=0, max_shard_bytes=SHARD_BYTES
    )
    return request.param, out


def test_samples_decode_to_what_was_written_and_what_the_target_computes(extracted, written, forward):
    codec, root = extracted
    samples = format_reader.read_samples(root)
    layers = format_reader.read_manifest(root)["spec"]["layer_ids"]
    _, records = written
    assert sorted(samples) == list(range(len(records)))
    assert len(format_reader.read_manifest(root)["shards"]) > 1
    exact = []
    for sid, record in enumerate(records):
        sample = samples[sid]
        assert sample.input_ids.tolist() == record["input_ids"] and sample.loss_mask.tolist() == record["loss_mask"]
        assert sample.record_id == record.get("id")
        hidden, logits = forward[1](record["input_ids"], layers)
        if codec == "fp8-zstd":
            # FORMAT.md: about 2% relative error; the bf16 rounding of a packed forward adds a little.
            assert np.linalg.norm(sample.hidden - hidden) / np.linalg.norm(hidden) < 0.04
        elif codec.startswith("fp4"):
            # FORMAT.md: about 6.5% relative error per token on activation-like states.
            assert np.linalg.norm(sample.hidden - hidden) / np.linalg.norm(hidden) < 0.12
        else:
            # Packed with other samples vs alone: the same math, but bf16 kernels of other shapes
            # round differently, by a few bf16 steps of these values (as tests/extract/test_extract.py).
            np.testing.assert_allclose(sample.hidden, hidden, atol=2e-2, rtol=2e-2)
        # The argmax may flip only between logits a bf16 rounding step apart.
        step = 2 * np.finfo(np.float32).eps * 2**16 * np.abs(logits).max(-1)
        for ids in (sample.target_ids, sample.topk_ids[:, 0]):
            gap = logits.max(-1) - np.take_along_axis(logits, ids[:, None].astype(np.int64), 1)[:, 0]
            assert (gap <= step).all()
            exact.extend(gap == 0)
        shifted = logits - logits.max(-1, keepdims=True)
        logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        expected = np.take_along_axis(logprobs, sample.topk_ids.astype(np.int64), 1)
        # Off by the logit's rounding and the log-sum-exp's: two such steps.
        assert (np.abs(sample.topk_logprobs - expected) <= 2 * step[:, None]).all()
    assert np.mean(exact) >= 0.9


def test_the_reference_reader_reads_the_same_values(extracted):
    """Bit for bit: FORMAT.md describes every byte the reference writer writes."""
    _, root = extracted
    samples, cache = format_reader.read_samples(root), open_cache(root)
    assert sorted(cache) == sorted(samples)
    for sid, sample in samples.items():
        ours = cache[sid]
        assert np.array_equal(sample.hidden, ours.hidden.float().numpy())
        assert np.array_equal(sample.target_ids, ours.target_ids.numpy())
        assert np.array_equal(sample.topk_ids, ours.topk_ids.numpy())
        assert np.array_equal(sample.topk_logprobs, ours.topk_logprobs.numpy())
        assert sample.record_id == ours.record_id


def test_target_folder_spec_and_journals_follow_format_md(extracted, forward, qwen3_target_dir):
    _, root = extracted
    manifest = format_reader.read_manifest(root)
    target = manifest["spec"]["target"]
    assert target["config_hash"] == format_reader.config_hash(root / "target" / "config.json")
    assert target["config_hash"] == format_reader.config_hash(qwen3_target_dir / "config.json")
    assert target["weights"] == {"content_hashed": True, "sha256": format_reader.weights_hash(qwen3_target_dir)}
    model = forward[0]
    head = format_reader.read_safetensors_bf16(root / "target" / "head.safetensors")
    for name, weight in [
        ("embed_tokens.weight", model.model.embed_tokens.weight),
        ("norm.weight", model.model.norm.weight),
        ("lm_head.weight", model.lm_head.weight),
    ]:
        assert np.array_equal(head[name], weight.detach().float().numpy()), name
    assert json.loads((root / "target" / "head.json").read_text())["norm_weight_offset"] == 0  # qwen3: rms(x) * w
    assert format_reader.journal_shards(root) == manifest["shards"]
