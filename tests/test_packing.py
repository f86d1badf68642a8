"""Packed extraction: the row plan, the bounded set of input shapes, and packed rows against each
sample run alone through the Hugging Face reference (dense qwen3 and hybrid qwen3_5)."""

import importlib
import importlib.util

import numpy as np
import pytest
import torch

from dflash_cache.data.dataset import Sample
from dflash_cache.extract.buckets import BucketLayout
from dflash_cache.extract.packing import PackedLayout, plan_rows
from dflash_cache.target.runner import TargetRunner
from dflash_cache.target.target import load_target
from dflash_cache.target.varlen import ATTENTION, packed_kernels


def lognormal_lengths(n: int, seed: int = 0, longest: int = 8192) -> list[int]:
    """Conversation lengths modelled on measured chat data: lognormal around 2,600 tokens, cut at the max length."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(2600), 0.9, n), 16, longest).astype(int).tolist()


def test_plan_rows_by_hand():
    # budget 10: 7 first, then the longest that fits (3); 6 + 4; 5 + 2 + 2 (smallest id first among equals) + 1
    rows = plan_rows([0, 1, 2, 3, 4, 5, 6, 7], [7, 3, 6, 4, 5, 2, 2, 1], 10)
    assert rows == [[0, 1], [2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="does not fit a row of 10"):
        plan_rows([0], [11], 10)
    assert plan_rows([], [], 10) == []


def test_plan_rows_covers_every_sample_once_and_fills_rows():
    lengths = lognormal_lengths(20_000)
    ids = list(range(100, 100 + len(lengths)))
    rows = plan_rows(ids, lengths, 49152)
    assert sorted(sid for row in rows for sid in row) == ids
    by_id = dict(zip(ids, lengths))
    used = [sum(by_id[s] for s in row) for row in rows]
    assert max(used) <= 49152
    assert min(used[:-1]) >= 0.99 * 49152  # every row but the last is nearly full
    assert max(by_id[s] for s in rows[0]) == max(lengths)  # long first
    assert rows == plan_rows(ids[::-1], lengths[::-1], 49152)  # a function of the data, not of its order


def test_a_million_samples_run_on_a_bounded_number_of_shapes():
    """The input shapes of a run over 1M realistic lengths: one for packed rows, at most one per
    length bucket for padded batches (16 for --max-length 8192); packed rows carry no padding
    beyond a fraction of a row. `shape` is what `build` gives the target: checked on some batches."""
    lengths = lognormal_lengths(1_000_000, seed=1)
    ids = list(range(len(lengths)))
    buffer, mask = np.zeros(max(lengths), dtype=np.int32), np.ones(max(lengths), dtype=bool)
    for layout, bound in [(PackedLayout(49152), 1), (BucketLayout(49152, 8192), 16)]:
        plan = layout.plan(ids, lengths)
        shapes = [layout.shape([lengths[i] for i in batch]) for batch in plan]
        assert len(set(shapes)) <= bound, (layout, sorted(set(shapes)))
        for k in range(0, len(plan), len(plan) // 50):
            built = layout.build([Sample(i, buffer[: lengths[i]], mask[: lengths[i]]) for i in plan[k]], "meta")
            assert built.shape == shapes[k] and sorted(built.sample_ids) == sorted(plan[k])
        positions = sum(b * t for b, t in shapes)
        assert positions < 1.2 * sum(lengths)
        if isinstance(layout, PackedLayout):
            assert positions < 1.001 * sum(lengths)


def random_samples(lengths, vocab_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(i, torch.randint(0, vocab_size, (n,), generator=g).numpy().astype(np.int32), np.ones(n, dtype=bool))
        for i, n in enumerate(lengths)
    ]


# Crosses the 64-token chunk of the linear-attention kernel, and ends on a partial row.
LENGTHS = [70, 5, 33, 130, 64]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_packed_row_equals_each_sample_alone(target_dir, device):
    if device == "cpu" and "qwen3_5" in str(target_dir) and importlib.util.find_spec("fla") is not None:
        pytest.skip(
            "transformers sends the CPU reference's linear attention to flash-linear-attention, which runs on GPUs only"
        )
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    target = load_target(target_dir, device, dtype, attention=ATTENTION)
    samples = random_samples(LENGTHS, target.vocab_size)
    layout = PackedLayout(400)
    fb = layout.build(samples, device)
    assert fb.shape == (1, 400) and fb.starts.tolist() == [0, 70, 75, 108, 238]
    out = TargetRunner(target, [0, 2, 5]).run_batch(fb)
    reference = load_target(target_dir, device, dtype)  # plain sdpa, HF's own code paths
    tol = dict(atol=1e-5, rtol=2**-7) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for sample, start in zip(samples, fb.starts.tolist()):
        n = len(sample.input_ids)
        ids = torch.from_numpy(sample.input_ids.astype(np.int64))[None].to(device)
        with torch.inference_mode():
            alone = reference.model(input_ids=ids, output_hidden_states=True)
        for slot, layer in enumerate([0, 2, 5]):
            expected = alone.hidden_states[layer + 1][0] if layer < 5 else None
            if expected is not None:
                torch.testing.assert_close(
                    out.hidden[0, start : start + n, slot * 64 : (slot + 1) * 64].float(),
                    expected.bfloat16().float(),
                    **tol,
                )
        logits = alone.logits[0].float()
        gap = logits.amax(-1) - logits.gather(1, out.target_ids[0, start : start + n, None])[:, 0]
        assert (gap <= 2 * torch.finfo(torch.bfloat16).eps * logits.abs().amax(-1)).all()
    assert (out.target_ids[0, sum(LENGTHS) :] == -1).all()  # the padding tail is not labelled


def test_boundaries_are_what_keeps_samples_apart(target_dir):
    """Negative control: the same row without the sample boundaries (one causal sequence), or under
    `packed_kernels` with the boundary between the first two samples left out, changes the second
    sample; with every boundary it is the sample alone (test above). Not a comparison with transformers'
    own handling of packed qwen3_5 rows outside `packed_kernels`: releases differ there (some mix the
    samples, some keep them apart, newer ones refuse without flash-linear-attention)."""
    target = load_target(target_dir, "cpu", torch.float32, attention=ATTENTION)
    samples = random_samples(LENGTHS, target.vocab_size)
    fb = PackedLayout(400).build(samples, "cpu")
    merged = fb.forward_kwargs()
    keep = [i for i, b in enumerate(fb.cu_seqlens_cpu.tolist()) if b != LENGTHS[0]]
    merged["position_ids"] = torch.cat([torch.arange(sum(LENGTHS[:2])), fb.position_ids[0, sum(LENGTHS[:2]) :]])[None]
    merged["cu_seq_lens_q"] = merged["cu_seq_lens_k"] = fb.cu_seqlens[keep]
    merged["cu_seq_lens_cpu"] = fb.cu_seqlens_cpu[keep]
    merged["max_length_q"] = merged["max_length_k"] = max(fb.max_seqlen, sum(LENGTHS[:2]))
    with torch.inference_mode():
        with packed_kernels(target.model):
            packed = target.base(input_ids=fb.input_ids, use_cache=False, **fb.forward_kwargs()).last_hidden_state
            joined = target.base(input_ids=fb.input_ids, use_cache=False, **merged).last_hidden_state
        plain = target.base(input_ids=fb.input_ids, use_cache=False).last_hidden_state
    second = slice(70, 75)
    assert not torch.allclose(packed[0, second], plain[0, second], atol=1e-3)
    assert not torch.allclose(packed[0, second], joined[0, second], atol=1e-3)


def test_packed_kernels_are_scoped():
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    before = module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule
    from transformers import AutoModelForCausalLM

    from tests.tiny import build_tokenizer, target_config

    model = AutoModelForCausalLM.from_config(target_config("qwen3_5", len(build_tokenizer())))
    with packed_kernels(model):
        assert module.causal_conv1d_fn is not before[0]
    assert (module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule) == before
