import copy

import pytest
import torch

from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.checkpoint import load_drafter, save_drafter
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.errors import DFlashCacheError
from tests.support.drafter import counting_backend, random_batch, random_head, tiny_drafter_config

LENGTHS = [23, 5, 40, 9]


def make_drafter(seed=0, **overrides):
    torch.manual_seed(seed)
    return DFlashDrafter(tiny_drafter_config(**overrides), random_head(seed), tile=16)


def inputs_for(lengths, seed=0, max_anchors=4):
    batch = random_batch(lengths, seed=seed)
    anchors = sample_anchors(batch, 4, max_anchors, torch.Generator().manual_seed(seed))
    return batch, anchors, DraftInputs.build(batch, anchors)


@torch.no_grad()
def test_flex_and_dense_attention_give_the_same_states():
    model = make_drafter()
    _, _, inputs = inputs_for(LENGTHS)
    flex = model.block_states(inputs)
    model.attention = "dense"
    torch.testing.assert_close(flex, model.block_states(inputs), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_flex_attention_takes_query_groups_that_do_not_divide_its_tile():
    """SmolLM2-135M's shape has 3 query heads per key head: 16-row tiles hold no whole groups of 3."""
    model = make_drafter(num_attention_heads=6, num_key_value_heads=2)
    _, _, inputs = inputs_for(LENGTHS)
    flex = model.block_states(inputs)
    model.attention = "dense"
    torch.testing.assert_close(flex, model.block_states(inputs), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_block_sees_only_its_own_context_and_block():
    model = make_drafter()
    batch, anchors, inputs = inputs_for(LENGTHS)
    starts = batch.cu_seqlens.long()[inputs.seq_ids[anchors]]
    later_in_sequence = torch.cat([inputs.seq_ids[anchors][1:] == inputs.seq_ids[anchors][:-1], torch.tensor([False])])
    j = int(((anchors - starts > 8) & later_in_sequence).nonzero()[0])  # long context, later blocks alongside
    a, start = int(anchors[j]), int(starts[j])
    seq = int(inputs.seq_ids[a])
    before = model.block_states(inputs)[j]

    def states_with(**changes):
        changed = DraftInputs(**{**inputs.__dict__, **changes})
        return model.block_states(changed)[j]

    other = inputs.seq_ids != seq
    after_anchor = torch.arange(batch.num_tokens) >= a
    for hidden_rows in (other, after_anchor):
        hidden = inputs.hidden.clone()
        hidden[hidden_rows] += 1
        torch.testing.assert_close(states_with(hidden=hidden), before)
    ids = inputs.input_ids.clone()
    ids[a + 1 :] = 0  # tokens after the anchor are masked in the block, never read
    torch.testing.assert_close(states_with(input_ids=ids), before)

    hidden = inputs.hidden.clone()
    hidden[a - 1] += 1  # the last context position: every layer type sees it
    assert not torch.allclose(states_with(hidden=hidden), before)
    window_edge = torch.zeros(batch.num_tokens, dtype=torch.bool)
    window_edge[start : a - 6] = True  # outside every sliding window: only the full layer sees it
    hidden = inputs.hidden.clone()
    hidden[window_edge] += 1
    assert not torch.allclose(states_with(hidden=hidden), before)


def test_backward_on_cpu_reaches_every_parameter():
    model = make_drafter()
    _, _, inputs = inputs_for(LENGTHS)
    out = model(inputs, gamma=4.0)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_autocast_runs_in_bf16():
    model = make_drafter()
    _, _, inputs = inputs_for(LENGTHS)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        states = model.block_states(inputs)
        loss = model(inputs).loss
    assert states.dtype == torch.bfloat16 and torch.isfinite(loss)


def test_compiled_mode_matches_eager_and_does_not_recompile():
    """aot_eager: the same graph capture and guards as inductor, without a minute of C++ compilation."""
    from torch._dynamo.backends.debugging import aot_eager

    graphs, counting = counting_backend(aot_eager)

    model = make_drafter(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    reference = copy.deepcopy(model)
    reference.attention = "dense"  # unfused flex on the CPU retraces per shape: slow for no extra check
    eager = DrafterRunner(reference)
    compiled = DrafterRunner(model, compiled=True, token_budget=96, anchor_budget=24, backend=counting)
    for lengths, seed in [(LENGTHS, 0), ([40, 15], 1), ([7, 7, 7, 7, 7, 30], 2)]:
        batch, anchors, _ = inputs_for(lengths, seed)
        with torch.no_grad():
            want, got = eager(batch, anchors, gamma=4.0), compiled(batch, anchors, gamma=4.0)
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.tau, want.tau)
        assert torch.equal(got.correct, want.correct) and torch.equal(got.total, want.total)
        assert got.num_blocks == want.num_blocks == len(anchors)
    assert len(graphs) == 1
    with pytest.raises(DFlashCacheError, match="budget"):
        batch, anchors, _ = inputs_for([100], 0)
        compiled(batch, anchors)


@pytest.mark.parametrize("loss", ["dpace", "topk"])
def test_compiled_mode_matches_eager_for_each_loss_with_gradients(loss):
    """The padded inputs carry the top-K labels, and D-PACE's weights (computed after the head's chunks)
    trace into the one graph; the compiled step's loss and gradients are eager's."""
    from torch._dynamo.backends.debugging import aot_eager

    model = make_drafter(num_hidden_layers=1, layer_types=["full_attention"])
    reference = copy.deepcopy(model)
    reference.attention = "dense"
    batch, anchors, _ = inputs_for(LENGTHS)
    g = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    batch.topk_ids = torch.rand(batch.num_tokens, vocab, generator=g).argsort(1)[:, :3]
    batch.topk_logprobs = torch.randn(batch.num_tokens, 3, generator=g).log_softmax(1)
    got = DrafterRunner(model, compiled=True, token_budget=96, anchor_budget=24, backend=aot_eager)(
        batch, anchors, gamma=4.0, loss=loss
    )
    want = DrafterRunner(reference)(batch, anchors, gamma=4.0, loss=loss)
    got.loss.backward()
    want.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_checkpoint_round_trip_excludes_the_head(tmp_path):
    model = make_drafter()
    save_drafter(model, tmp_path)
    assert not any(k.startswith("head") or "embed" in k or "lm_head" in k for k in model.state_dict())
    loaded = load_drafter(tmp_path, head=random_head(0), tile=16)
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    _, _, inputs = inputs_for(LENGTHS)
    with torch.no_grad():
        torch.testing.assert_close(loaded(inputs).loss, model(inputs).loss)


def test_to_moves_the_head_and_a_missing_head_is_an_error():
    model = make_drafter().to(torch.float64)
    assert model.head.lm_head.dtype == torch.float64 and model.fc.weight.dtype == torch.float64
    _, _, inputs = inputs_for(LENGTHS)
    with pytest.raises(DFlashCacheError, match="head"):
        DFlashDrafter(tiny_drafter_config()).block_states(inputs)


def test_a_batch_without_anchors_gives_zero_loss_and_zero_gradients():
    """Every parameter still takes part (a DDP rank with an empty batch must join the all-reduce)."""
    model = make_drafter()
    batch = random_batch([10, 5])
    inputs = DraftInputs.build(batch, torch.zeros(0, dtype=torch.long))
    with torch.no_grad():
        assert model(inputs).loss == 0
    out = model(inputs)
    out.loss.backward()
    assert out.loss == 0 and out.num_blocks == 0 and out.total.sum() == 0
    for name, p in model.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


def test_the_compiled_runner_passes_its_mode_to_torch_compile(monkeypatch):
    seen = {}

    def recording_compile(module, **kwargs):
        seen.update(kwargs)
        return module

    monkeypatch.setattr(torch, "compile", recording_compile)
    DrafterRunner(make_drafter(), compiled=True, token_budget=96, anchor_budget=24, compile_mode="reduce-overhead")
    assert seen == {"dynamic": False, "backend": "inductor", "mode": "reduce-overhead"}
