"""TargetRunner against the Hugging Face reference: hooked layers, chunked labels, early stop,
padding, sample checks and the out-of-memory split."""

import pytest
import torch

from dflash_cache.extract.checks import describe_problem, layer_health
from dflash_cache.extract.runner import TargetRunner
from dflash_cache.extract.split import SampleOutOfMemory, run_with_split
from dflash_cache.extract.target import load_target

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
    health = layer_health(out.hidden, LENGTHS, len(LAYERS)).numpy()
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
    lengths = torch.tensor([10, 6, 10], device=device)
    hidden[1, 6:] = float("nan")  # padding: not a problem
    hidden[0, :, 8:16] = 0  # sample 0: layer 9 all zeros
    hidden[2, [2, 5], 20] = float("inf")  # sample 2: layer 17 broken at 2 tokens
    health = layer_health(hidden, lengths, len(layers)).cpu().numpy()
    assert describe_problem(health[0], layers, 10) == "layer 9 is all zeros"
    assert describe_problem(health[1], layers, 6) is None
    assert describe_problem(health[2], layers, 10) == "layer 17 has NaN/Inf values at 2 of 10 tokens"
    hidden[2, 3, 0] = float("nan")
    health = layer_health(hidden, lengths, len(layers)).cpu().numpy()
    assert describe_problem(health[2], layers, 10) == "layer 1 has NaN/Inf values at 1 of 10 tokens"


class FakeOOMRunner(TargetRunner):
    """Raises the CUDA out-of-memory error for batches of more than `limit` padded tokens."""

    def __init__(self, *args, limit: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.limit = limit
        self.shapes = []

    def run(self, input_ids, lengths):
        self.shapes.append(tuple(input_ids.shape))
        if input_ids.numel() > self.limit:
            raise torch.cuda.OutOfMemoryError("fake: CUDA out of memory")
        return super().run(input_ids, lengths)


def test_oom_splits_the_batch_down_to_single_samples(qwen3_target_dir):
    target = load_target(qwen3_target_dir, "cpu", torch.float32)
    lengths = torch.tensor([30, 4, 12, 20, 7])
    input_ids = right_padded_batch(target.vocab_size, lengths)
    sample_ids = [100, 101, 102, 103, 104]
    runner = FakeOOMRunner(target, [1, 3], limit=40)

    parts = list(run_with_split(runner, input_ids, lengths, sample_ids))
    assert runner.shapes == [(5, 30), (2, 30), (1, 30), (1, 4), (3, 20), (1, 12), (2, 20)]
    assert [p.sample_ids for p in parts] == [[100], [101], [102], [103, 104]]
    whole = TargetRunner(target, [1, 3]).run(input_ids, lengths)
    row = 0
    for part in parts:
        for b, n in enumerate(part.lengths.tolist()):
            assert n == lengths[row]
            torch.testing.assert_close(part.output.hidden[b, :n], whole.hidden[row, :n], atol=1e-5, rtol=2**-7)
            assert torch.equal(part.output.target_ids[b, :n], whole.target_ids[row, :n])
            row += 1
    assert row == 5

    # A sample that does not fit alone names itself.
    runner = FakeOOMRunner(target, [1, 3], limit=25)
    with pytest.raises(SampleOutOfMemory, match="sample 100 \\(30 tokens\\)") as info:
        list(run_with_split(runner, input_ids, lengths, sample_ids))
    assert info.value.sample_id == 100
