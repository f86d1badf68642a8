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


def random_inputs(seed: int, n: int = 23, vocab: int = 13, k: int = 4, anchors=(0, 3, 6, 11, 15, 17)):
    """One packed sequence of random tokens, loss mask, target labels and top-K labels."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 2
    return DraftInputs(
        input_ids=torch.randint(0, vocab, (n,), generator=g),
        loss_mask=torch.rand(n, generator=g) > 0.25,
        target_ids=torch.randint(0, vocab, (n,), generator=g),
        hidden=torch.zeros(n, 1),
        positions=torch.arange(n),
        seq_ids=torch.zeros(n, dtype=torch.long),
        anchors=torch.tensor(anchors),
        topk_ids=torch.rand(n, vocab, generator=g).argsort(1)[:, :k],
        topk_logprobs=logits.log_softmax(1).sort(1, descending=True).values[:, :k],
    )


def reference_loss(states, lm_head, inputs, loss, gamma=2.0, alpha=0.5, labels="target"):
    """The objective in float64, one slot at a time, written from the definitions (drafter/loss.py,
    drafter/dpace.py) rather than from the code under test."""
    a_count, block, _ = states.shape
    logp = torch.log_softmax(states.double() @ lm_head.double().T, dim=-1)
    terms, weights = {}, {}
    for a in range(a_count):
        anchor = int(inputs.anchors[a])
        for k in range(1, block):
            if not inputs.loss_mask[anchor + k]:
                continue
            label = int(inputs.target_ids[anchor + k - 1] if labels == "target" else inputs.input_ids[anchor + k])
            if loss == "topk":
                ids = inputs.topk_ids[anchor + k - 1].tolist()
                p = [math.exp(float(v)) for v in inputs.topk_logprobs[anchor + k - 1]]
                terms[a, k] = -sum(pj / sum(p) * logp[a, k, i] for pj, i in zip(p, ids))
            else:
                terms[a, k] = -logp[a, k, label]
            weights[a, k] = math.exp(-(k - 1) / gamma)
    if loss != "dpace":
        return sum(weights[s] * terms[s] for s in terms) / sum(weights.values())
    q = {s: alpha + (1 - alpha) * math.exp(-float(terms[s].detach())) for s in terms}  # smoothed, no gradient
    total = 0.0
    for (a, k), term in terms.items():
        # sum over counted later slots m >= k of the product of q over counted slots i <= m
        reach = [math.prod(q[a, i] for i in range(1, m + 1) if (a, i) in q) for m in range(k, block) if (a, m) in q]
        total = total + sum(reach) * term
    return total / len(terms)


@pytest.mark.parametrize(
    "loss, labels",
    [("dflash", "target"), ("dflash", "tokens"), ("dpace", "target"), ("dpace", "tokens"), ("topk", "target")],
)
def test_each_loss_and_its_gradient_match_a_float64_reference(loss, labels, monkeypatch):
    """Chunks of 5 rows (blocks have 4 slots scored) split blocks, so D-PACE's block-wide weights
    are applied after every chunk has run."""
    from dflash_cache.drafter import head_loss

    block, vocab, hidden = 5, 13, 8
    monkeypatch.setattr(head_loss, "LOGITS_PER_CHUNK", 5 * vocab)
    inputs = random_inputs(1, vocab=vocab)
    g = torch.Generator().manual_seed(2)
    lm_head = torch.randn(vocab, hidden, generator=g)
    states = torch.randn(len(inputs.anchors), block, hidden, generator=g, requires_grad=True)

    out = drafter_loss(states, lm_head, inputs, 2.0, labels, loss=loss, dpace_alpha=0.3)
    out.loss.backward()
    reference_states = states.detach().double().requires_grad_()
    want = reference_loss(reference_states, lm_head, inputs, loss, alpha=0.3, labels=labels)
    want.backward()
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states.grad.double(), reference_states.grad, rtol=1e-4, atol=1e-6)
    assert out.total.sum() > 0 and states.grad[:, 0].abs().sum() == 0


def test_dpace_weights_by_hand():
    """One block of three counted slots whose drafter gives the label probabilities 1, 0.5 and 0, and
    alpha 0.5: smoothed 1, 0.75, 0.5; reach 1, 0.75, 0.375; weights their suffix sums."""
    from dflash_cache.drafter.dpace import dpace_weights

    nll = -torch.log(torch.tensor([[1.0, 0.5, 1e-30], [1.0, 0.5, 1e-30]]))
    counted = torch.tensor([[True, True, True], [True, False, True]])
    weights = dpace_weights(nll, counted, 0.5)
    torch.testing.assert_close(weights[0], torch.tensor([2.125, 1.125, 0.375]))
    # an uncounted slot is skipped: a factor of 1, no weight, no term
    torch.testing.assert_close(weights[1], torch.tensor([1.5, 0.0, 0.5]))
    torch.testing.assert_close(dpace_weights(nll, counted, 1.0)[0], torch.tensor([3.0, 2.0, 1.0]))


def test_topk_loss_needs_top_k_labels_and_target_labels():
    inputs = random_inputs(0)
    states = torch.randn(len(inputs.anchors), 5, 8)
    lm_head = torch.randn(13, 8)
    with pytest.raises(DFlashCacheError, match="--labels target"):
        drafter_loss(states, lm_head, inputs, 2.0, "tokens", loss="topk")
    inputs.topk_ids = inputs.topk_logprobs = None
    with pytest.raises(DFlashCacheError, match="extract it with --topk K"):
        drafter_loss(states, lm_head, inputs, 2.0, "target", loss="topk")
    with pytest.raises(DFlashCacheError, match="unknown loss"):
        drafter_loss(states, lm_head, inputs, 2.0, "target", loss="kl")
