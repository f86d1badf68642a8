"""Cross-entropy through the frozen LM head, a chunk of rows at a time.

Full logits for 512 blocks x 15 slots x a 248K vocabulary would take gigabytes; here each chunk's
logits live only inside the forward. Because the head is frozen, the gradient with respect to the
drafter's states, (softmax - onehot) * row_weight @ W, is computed in the same pass and kept for
backward: no logits are stored and none are recomputed.
"""

from __future__ import annotations

import torch

LOGITS_PER_CHUNK = 1 << 28  # fp32 logits elements per chunk (1 GiB)


class HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, row_weights: torch.Tensor, chunk_rows: int):
        """states [R, H], weight [V, H] (frozen), labels [R], row_weights [R].

        Returns (sum_r row_weights[r] * CE_r, argmax predictions [R])."""
        rows = states.shape[0]
        loss = states.new_zeros((), dtype=torch.float32)
        predictions = torch.empty(rows, dtype=torch.long, device=states.device)
        grad = torch.empty_like(states) if ctx.needs_input_grad[0] else None
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            logits = (states[start:end].to(weight.dtype) @ weight.T).float()
            label = labels[start:end, None]
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            scale = row_weights[start:end, None].float()
            loss = loss + ((lse - logits.gather(1, label)) * scale).sum()
            predictions[start:end] = logits.argmax(-1)
            if grad is not None:
                probs = logits.sub_(lse).exp_()
                probs.scatter_add_(1, label, torch.full_like(label, -1, dtype=probs.dtype))
                grad[start:end] = probs.mul_(scale).to(weight.dtype) @ weight
        ctx.mark_non_differentiable(predictions)
        ctx.save_for_backward(grad)
        return loss, predictions

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_predictions: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss).to(grad.dtype), None, None, None, None


def head_cross_entropy(
    states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, row_weights: torch.Tensor, chunk_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted CE sum over rows, argmax predictions) for states [R, H] through the head weight [V, H]."""
    if chunk_rows is None:
        chunk_rows = max(1, LOGITS_PER_CHUNK // weight.shape[0])
    return HeadCrossEntropy.apply(states, weight.detach(), labels, row_weights, chunk_rows)
