"""The eager drafter's compiled regions (drafter/regions.py): the same losses and gradients as the plain
module, one compilation for every batch shape, and transparent inside a whole-drafter compile.

Mostly under aot_eager (the same capture, guards and autograd graphs as inductor, without its code
generation), once under Inductor itself. With gradients the CPU trains through the dense reference
attention; tests/drafter/test_gpu.py runs the regions with flex-attention on a GPU."""

import copy

import pytest
import torch

from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.compile_audit import CompileCounts, distinct_length_plans
from dflash_cache.drafter.head_loss import chunk_sizes, chunk_terms, head_cross_entropy
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.drafter.runner import DrafterRunner
from tests.support.drafter import (
    assert_same_gradients,
    counting_backend,
    random_batch,
    random_head,
    tiny_drafter_config,
)


def drafters():
    torch.manual_seed(0)
    plain = DFlashDrafter(tiny_drafter_config(), random_head(0), tile=16, attention="dense")
    regional = copy.deepcopy(plain)
    return plain, regional


def step(runner, model, lengths, seed):
    batch = random_batch(lengths, seed=seed)
    anchors = sample_anchors(batch, 4, 6, torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    out = runner(batch, anchors, gamma=4.0)
    out.loss.backward()
    return out


def test_regions_give_the_plain_drafters_losses_and_gradients():
    plain, regional = drafters()
    eager = DrafterRunner(plain, regions=False)
    regions = DrafterRunner(regional, regions=True, backend="aot_eager")
    assert regional.regions_backend == "aot_eager" and plain.regions_backend is None
    for lengths, seed in [([23, 5, 40, 9], 0), ([40, 15], 1), ([7, 7, 7, 7, 7, 30], 2)]:
        want, got = step(eager, plain, lengths, seed), step(regions, regional, lengths, seed)
        torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-6)
        assert torch.equal(got.correct, want.correct) and torch.equal(got.total, want.total)
        assert_same_gradients(regional, plain, atol=1e-6, rtol=1e-5)


def test_regions_compile_nothing_after_two_batches_whatever_the_shapes():
    torch._dynamo.reset()
    _, regional = drafters()
    runner = DrafterRunner(regional, regions=True, backend="aot_eager")
    plans = distinct_length_plans(12, 160, seed=5)
    start = CompileCounts.now()
    for k, lengths in enumerate(plans[:2]):
        step(runner, regional, lengths, k)
    warmup = CompileCounts.now() - start
    assert warmup.frames >= 4  # each region compiled: the layers (one per attention type), context, loss
    for k, lengths in enumerate(plans[2:], 2):
        before = CompileCounts.now()
        step(runner, regional, lengths, k)
        after = CompileCounts.now() - before
        assert not after.compiled_anything, (k, after.reasons)


@pytest.mark.slow
def test_regions_under_inductor_match_the_plain_drafter_and_compile_once():
    """Inductor's own code generation (C++ on the CPU; about 30 s), with the regions' Inductor options:
    the plain module's losses and gradients, and nothing compiled after the first batch."""
    torch._dynamo.reset()
    plain, regional = drafters()
    eager = DrafterRunner(plain, regions=False)
    regions = DrafterRunner(regional, regions=True, backend="inductor")
    for k, lengths in enumerate(distinct_length_plans(6, 160, seed=5)):
        before = CompileCounts.now()
        want, got = step(eager, plain, lengths, k), step(regions, regional, lengths, k)
        compiled = CompileCounts.now() - before
        assert k == 0 or not compiled.compiled_anything, (k, compiled.reasons)
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
        assert_same_gradients(regional, plain, atol=1e-5, rtol=1e-4)


def test_a_whole_drafter_compile_traces_through_the_regions():
    """train builds its eager evaluation runner (regions) beside a compiled training runner."""
    from torch._dynamo.backends.debugging import aot_eager

    graphs, counting = counting_backend(aot_eager)

    torch._dynamo.reset()
    plain, regional = drafters()
    regional.compile_regions("aot_eager")
    compiled = DrafterRunner(regional, compiled=True, token_budget=96, anchor_budget=24, backend=counting)
    eager = DrafterRunner(plain, regions=False)
    for lengths, seed in [([23, 5, 40, 9], 0), ([40, 15], 1)]:
        want, got = step(eager, plain, lengths, seed), step(compiled, regional, lengths, seed)
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    assert len(graphs) == 1


def test_head_loss_chunks_are_whole_tiles_and_never_a_single_row():
    assert chunk_sizes(7680, 1081) == [1024] * 7 + [512]  # the 27B drafter's 512 anchors, 248,320 logits a row
    assert chunk_sizes(2 * 1024 + 5, 1081) == [1024, 1029]
    assert chunk_sizes(15, 1081) == [15] and chunk_sizes(1024, 1081) == [1024]

    g = torch.Generator().manual_seed(0)
    states = torch.randn(7, 8, generator=g, requires_grad=True)
    weight, labels, row_weights = (
        torch.randn(11, 8, generator=g),
        torch.randint(0, 11, (7,), generator=g),
        torch.rand(7, generator=g),
    )
    sizes = []

    def recording(s, *args):
        sizes.append(s.shape[0])
        return chunk_terms(s, *args)

    loss, predictions = head_cross_entropy(states, weight, labels, row_weights, chunk_rows=3, terms=recording)
    assert sizes == [3, 4]
    logits = states @ weight.T
    expected = (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * row_weights).sum()
    torch.testing.assert_close(loss, expected)
    assert torch.equal(predictions, logits.argmax(-1))
    loss.backward()
    reference = states.detach().clone().requires_grad_()
    (torch.nn.functional.cross_entropy(reference @ weight.T, labels, reduction="none") * row_weights).sum().backward()
    torch.testing.assert_close(states.grad, reference.grad)
