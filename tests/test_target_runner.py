"""TargetRunner against the Hugging Face reference: hooked layers, chunked labels, early stop,
padding, sample checks and the out-of-memory split."""

import numpy as np
import pytest
import torch

from dflash_cache.data.dataset import Sample
from dflash_cache.extract.buckets import BucketLayout
from dflash_cache.extract.checks import describe_problem, layer_health
from dflash_cache.extract.packing import PackedLayout
from dflash_cache.extract.split import SampleOutOfMemory, run_with_split
from dflash_cache.target.runner import TargetRunner
from dflash_cache.target.target import load_target

LAYERS = [0, 2, 3, 5]  # first, middle and last (5) of the tiny 6-layer targets
# Longest sample crosses the 64-token chunk of the linear-attention kernel; the pads are random
# tokens, so any leak from the padding tail into real tokens would show.
LENGTHS = torch.tensor([70, 5, 33])
DTYPES = [torch.float32, torch.bfloat16]


def right_padded_batch(vocab_size: int, lengths=LENGTHS, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (len(lengths), int(lengths.max())), generator=g)


def layer(hidden: torch.Tensor, slot: int, width: int = 64) -> torch.Tensor:
    return hidden[..., slot * width : (slot + 1) * width]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_hidden_matches_hf_reference(target_dir, dtype):
    target = load_target(target_dir, "cpu", dtype)
    input_ids = right_padded_batch(target.vocab_size)
    out = TargetRunner(target, LAYERS, labels=False).run(input_ids, LENGTHS)
    assert out.hidden.shape == (3, 70, len(LAYERS) * 64) and out.hidden.dtype == torch.bfloat16
    assert out.target_ids is None and out.topk_ids is None

    # Same padded batch: the hooks see exactly the tensors HF reports, so equality is bitwise.
    ref = target.model(input_ids=input_ids, output_hidden_states=True).hidden_states
    for slot, i in enumerate(LAYERS[:-1]):
        assert torch.equal(layer(out.hidden, slot), ref[i + 1].bfloat16()), f"layer {i}"
    # HF replaces the last entry with the final-normed state; ours is the raw layer output.
    last = target.base.norm(layer(out.hidden, 3).to(dtype))
    torch.testing.assert_close(last.bfloat16(), ref[-1].bfloat16(), atol=2e-2, rtol=2e-2)

    # Each sample alone, unpadded: equal up to bf16 rounding. Different batch shapes pick different
    # matmul kernels, so sums are ordered differently: for an fp32 model that is at most one bf16
    # step after the final cast; a bf16 model also rounds every intermediate, a few steps at most.
    # A padding leak would change the values at the scale of the values themselves.
    tol = dict(atol=1e-5, rtol=2**-7) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for b, n in enumerate(LENGTHS.tolist()):
        alone = target.model(input_ids=input_ids[b : b + 1, :n], output_hidden_states=True).hidden_states
        for slot, i in enumerate(LAYERS[:-1]):
            torch.testing.assert_close(layer(out.hidden[b, :n], slot), alone[i + 1][0].bfloat16(), **tol)
    health = layer_health(out.hidden, torch.arange(3) * 70, LENGTHS, len(LAYERS)).numpy()
    assert all(describe_problem(health[b], LAYERS, int(n)) is None for b, n in enumerate(LENGTHS.tolist()))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_labels_match_hf_logits(target_dir, dtype):
    target = load_target(target_dir, "cpu", dtype)
    input_ids = right_padded_batch(target.vocab_size, seed=1)
    # A 7-token chunk makes chunks straddle sample boundaries.
    out = TargetRunner(target, LAYERS, topk=4, lm_head_chunk=7).run(input_ids, LENGTHS)
    logits = target.model(input_ids=input_ids).logits
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(4, dim=-1)
    for b, n in enumerate(LENGTHS.tolist()):
        assert torch.equal(out.target_ids[b, :n], logits[b, :n].argmax(-1))
        assert torch.equal(out.topk_ids[b, :n], ids[b, :n])
        torch.testing.assert_close(out.topk_logprobs[b, :n], values[b, :n], atol=1e-5, rtol=1e-5)
        assert (out.target_ids[b, n:] == -1).all() and (out.topk_ids[b, n:] == -1).all()
    assert out.topk_logprobs.dtype == torch.float32
    # The sharpened tiny heads give confident predictions; a constant or shifted label would fail.
    assert len(out.target_ids[0, :70].unique()) > 5


def count_calls(target):
    calls = {i: 0 for i in range(target.num_layers)} | {"norm": 0}

    def counter(key):
        def hook(*_):
            calls[key] += 1

        return hook

    handles = [target.layers[i].register_forward_hook(counter(i)) for i in range(target.num_layers)]
    handles.append(target.base.norm.register_forward_hook(counter("norm")))
    return calls, handles


def test_without_labels_the_forward_stops_after_the_deepest_layer(target_dir):
    target = load_target(target_dir, "cpu")
    input_ids = right_padded_batch(target.vocab_size)
    calls, handles = count_calls(target)
    stopped = TargetRunner(target, [1, 3], labels=False).run(input_ids, LENGTHS)
    assert calls == {0: 1, 1: 1, 2: 1, 3: 1, 4: 0, 5: 0, "norm": 0}
    full = TargetRunner(target, [1, 3]).run(input_ids, LENGTHS)
    assert calls == {0: 2, 1: 2, 2: 2, 3: 2, 4: 1, 5: 1, "norm": 1}
    assert torch.equal(stopped.hidden, full.hidden)
    for h in handles:
        h.remove()
    # The runner's own hooks are gone after each run, also after an early stop.
    assert all(not target.layers[i]._forward_hooks for i in range(target.num_layers))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_health_checks_report_bad_layers_and_ignore_padding(device):
    layers = [1, 9, 17]
    hidden = torch.randn(3, 10, 3 * 8).bfloat16().to(device)
    offsets, lengths = torch.tensor([0, 10, 20], device=device), torch.tensor([10, 6, 10], device=device)
    hidden[1, 6:] = float("nan")  # padding: not a problem
    hidden[0, :, 8:16] = 0  # sample 0: layer 9 all zeros
    hidden[2, [2, 5], 20] = float("inf")  # sample 2: layer 17 broken at 2 tokens
    health = layer_health(hidden, offsets, lengths, len(layers)).cpu().numpy()
    assert describe_problem(health[0], layers, 10) == "layer 9 is all zeros"
    assert describe_problem(health[1], layers, 6) is None
    assert describe_problem(health[2], layers, 10) == "layer 17 has NaN/Inf values at 2 of 10 tokens"
    hidden[2, 3, 0] = float("nan")
    health = layer_health(hidden, offsets, lengths, len(layers)).cpu().numpy()
    assert describe_problem(health[2], layers, 10) == "layer 1 has NaN/Inf values at 1 of 10 tokens"


def test_health_checks_of_packed_samples():
    """Two samples in one row at positions 0-4 and 7-11; the gap and the tail are padding."""
    layers = [0, 1]
    hidden = torch.randn(1, 16, 2 * 8).bfloat16()
    hidden[0, 5:7] = float("nan")
    hidden[0, 12:] = 0
    hidden[0, 9, 3] = float("-inf")  # second sample, layer 0
    health = layer_health(hidden, torch.tensor([0, 7]), torch.tensor([5, 5]), len(layers)).numpy()
    assert health.shape == (2, 2, 2)
    assert describe_problem(health[0], layers, 5) is None
    assert describe_problem(health[1], layers, 5) == "layer 0 has NaN/Inf values at 1 of 5 tokens"
    hidden[0, 0:5, 8:] = 0
    health = layer_health(hidden, torch.tensor([0, 7]), torch.tensor([5, 5]), len(layers)).numpy()
    assert describe_problem(health[0], layers, 5) == "layer 1 is all zeros"


class FakeOOMRunner(TargetRunner):
    """Raises the CUDA out-of-memory error for forwards of more than `limit` positions."""

    def __init__(self, *args, limit: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.limit = limit
        self.shapes = []

    def run_batch(self, fb):
        self.shapes.append(fb.shape)
        if fb.input_ids.numel() > self.limit:
            raise torch.cuda.OutOfMemoryError("fake: CUDA out of memory")
        return super().run_batch(fb)


def samples_of(lengths, vocab_size, first_id=100):
    g = torch.Generator().manual_seed(3)
    return [
        Sample(first_id + i, torch.randint(0, vocab_size, (n,), generator=g).numpy().astype(np.int32), np.ones(n, bool))
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize(
    "layout, limit, shapes",
    [
        # a row of 128 does not fit: halves of 2 and 3 samples in rows of max(128 / 2, their tokens rounded up to 64)
        (PackedLayout(128), 64, [(1, 128), (1, 64), (1, 64)]),
        # 5 rows of the 64-token bucket do not fit: halves on ceil(5 / 2) rows
        (BucketLayout(token_budget=320, max_length=64), 192, [(5, 64), (3, 64), (3, 64)]),
    ],
    ids=["packed", "padded"],
)
def test_oom_splits_the_batch(qwen3_target_dir, layout, limit, shapes):
    target = load_target(qwen3_target_dir, "cpu", torch.float32, attention=layout.attention)
    samples = samples_of([30, 4, 12, 20, 7], target.vocab_size)
    runner = FakeOOMRunner(target, [1, 3], limit=limit)
    parts = list(run_with_split(runner, layout, samples, "cpu"))
    assert runner.shapes == shapes
    assert [p.sample_ids for p in parts] == [[100, 101], [102, 103, 104]]
    done = [(sid, part, i) for part in parts for i, sid in enumerate(part.sample_ids)]
    for (_sid, part, i), sample in zip(done, samples):
        n, row, start = len(sample.input_ids), int(part.batch.rows[i]), int(part.batch.starts[i])
        alone = target.model(
            input_ids=torch.from_numpy(sample.input_ids.astype(np.int64))[None], output_hidden_states=True
        )
        torch.testing.assert_close(
            layer(part.output.hidden[row, start : start + n], 0, 64),
            alone.hidden_states[2][0].bfloat16(),
            atol=1e-5,
            rtol=2**-7,
        )
        assert torch.equal(part.output.target_ids[row, start : start + n], alone.logits[0].argmax(-1))


def test_a_sample_that_does_not_fit_alone_names_itself(qwen3_target_dir):
    target = load_target(qwen3_target_dir, "cpu", torch.float32, attention=PackedLayout(128).attention)
    runner = FakeOOMRunner(target, [1, 3], limit=16)
    with pytest.raises(SampleOutOfMemory, match="sample 100 \\(30 tokens\\)") as info:
        list(run_with_split(runner, PackedLayout(128), samples_of([30, 4, 12, 20, 7], target.vocab_size), "cpu"))
    assert info.value.sample_id == 100


@pytest.mark.parametrize(
    "layout", [PackedLayout(384), BucketLayout(token_budget=768, max_length=256)], ids=["packed", "padded"]
)
def test_a_batch_gives_the_same_bits_with_any_thread_count(qwen3_target_dir, layout):
    """Extraction leaves torch's thread count alone, and a resumed run may have another (two ranks
    sharing a node's cores): the same batch comes out bit for bit the same on 1, 2 or 3 CPU threads."""
    target = load_target(qwen3_target_dir, "cpu", attention=layout.attention)
    runner = TargetRunner(target, [1, 4])
    samples = samples_of([200, 120, 40], target.vocab_size)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outputs.append(runner.run_batch(layout.build(samples, "cpu")))
    finally:
        torch.set_num_threads(threads)
    for out in outputs[1:]:
        assert torch.equal(out.hidden.view(torch.int16), outputs[0].hidden.view(torch.int16))
        assert torch.equal(out.target_ids, outputs[0].target_ids)
