import math

import pytest
import torch
import torch.nn.functional as F

from dflash_cache.drafter.head_loss import head_cross_entropy
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.loss import acceptance, block_labels, drafter_loss, slot_weights
from dflash_cache.errors import DFlashCacheError


def test_slot_weights():
    w = slot_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    torch.testing.assert_close(w, torch.tensor([math.exp(-(k - 1) / 7.0) for k in range(1, 16)]))


def test_head_cross_entropy_matches_plain_cross_entropy_in_chunks():
    g = torch.Generator().manual_seed(0)
    states = torch.randn(11, 8, generator=g, requires_grad=True)
    weight = torch.randn(13, 8, generator=g)
    labels = torch.randint(0, 13, (11,), generator=g)
    row_weights = torch.rand(11, generator=g)

    loss, predictions = head_cross_entropy(states, weight, labels, row_weights, chunk_rows=3)
    loss.backward()
    logits = states @ weight.T
    expected = (F.cross_entropy(logits, labels, reduction="none") * row_weights).sum()
    (expected_grad,) = torch.autograd.grad(expected, states)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(states.grad, expected_grad)
    assert torch.equal(predictions, logits.argmax(-1))


def test_acceptance_counts_leading_counted_hits():
    hits = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    counted = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    tau, num_blocks = acceptance(hits, counted)
    # accepted lengths 3, 1, 5 and 2 (an uncounted slot ends the run); the last block has no counted slot
    assert num_blocks == 4
    assert tau.item() == pytest.approx((3 + 1 + 5 + 2) / 4)


def one_sequence_inputs(loss_mask, anchors):
    n = len(loss_mask)
    return DraftInputs(
        input_ids=torch.arange(100, 100 + n),
        loss_mask=torch.tensor(loss_mask, dtype=torch.bool),
        target_ids=torch.arange(200, 200 + n),
        hidden=torch.zeros(n, 1),
        positions=torch.arange(n),
        seq_ids=torch.zeros(n, dtype=torch.long),
        anchors=torch.tensor(anchors),
    )


def test_block_labels_target_and_tokens():
    inputs = one_sequence_inputs([0, 1, 1, 0, 1, 1, 1, 1], [1, 4])
    wanted, counted = block_labels(inputs, 4, "target")
    assert wanted.tolist() == [[201, 202, 203], [204, 205, 206]]  # target_ids[a+k-1]
    assert counted.tolist() == [[True, False, True], [True, True, True]]  # loss_mask[a+k]
    wanted, _ = block_labels(inputs, 4, "tokens")
    assert wanted.tolist() == [[102, 103, 104], [105, 106, 107]]  # input_ids[a+k]
    with pytest.raises(DFlashCacheError):
        block_labels(inputs, 4, "logits")


def test_drafter_loss_weights_masks_and_metrics():
    """States chosen so the head predicts chosen tokens; the loss is the weighted mean of the
    counted slots' cross-entropies."""
    block, vocab, gamma = 4, 300, 2.0
    inputs = one_sequence_inputs([0, 1, 1, 0, 1, 1, 1, 1], [1, 4])
    lm_head = torch.eye(vocab) * 5
    predicted = torch.tensor([[201, 0, 203], [204, 205, 0]])  # block 0: hit, miss, hit; block 1: hit, hit, miss
    states = torch.zeros(2, block, vocab)
    states[:, 1:] = F.one_hot(predicted, vocab).float()
    states.requires_grad_(True)

    out = drafter_loss(states, lm_head, inputs, gamma, labels="target")
    wanted, counted = block_labels(inputs, block, "target")
    ce = F.cross_entropy(states[:, 1:].detach().reshape(-1, vocab) @ lm_head.T, wanted.reshape(-1), reduction="none")
    w = torch.exp(-torch.arange(3) / gamma) * counted
    torch.testing.assert_close(out.loss, (ce.view(2, 3) * w).sum() / w.sum())
    # block 0: slot 2 is not counted (loss_mask[3] is 0), so only slots 1 and 3 count
    assert out.total.tolist() == [2, 1, 2]
    assert out.correct.tolist() == [2, 1, 1]
    assert out.num_blocks == 2
    assert out.tau.item() == pytest.approx((2 + 3) / 2)  # block 0 stops at the uncounted slot 2
    torch.testing.assert_close(out.accuracy, torch.tensor([1.0, 1.0, 0.5]))
    out.loss.backward()
    assert states.grad[:, 0].abs().sum() == 0 and states.grad[0, 2].abs().sum() == 0
    assert states.grad[1, 3].abs().sum() > 0
