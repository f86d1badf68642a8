"""Run the target on one forward batch (packed rows or right-padded rows, target/batch.py): capture
the chosen layers with hooks, and label every real token with the target's own next-token
prediction through a chunked LM head."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

import torch

from dflash_cache.data.dataset import Sample
from dflash_cache.target.batch import ForwardBatch, padded_rows, to_device
from dflash_cache.target.fused import fused_kernels
from dflash_cache.target.kvcache import Cache, cache_kwargs
from dflash_cache.target.target import Target
from dflash_cache.target.varlen import packed_kernels


@dataclass
class TargetOutput:
    """Per-position results for a forward batch; positions no sample occupies are junk in `hidden`
    and -1 / 0 in the label tensors."""

    hidden: torch.Tensor  # [B, T, L*H] bf16, column block j is layer layer_ids[j]'s output
    target_ids: torch.Tensor | None  # [B, T] int64, argmax of the target's logits
    topk_ids: torch.Tensor | None  # [B, T, K] int64
    topk_logprobs: torch.Tensor | None  # [B, T, K] float32


def padded_batch(samples: list[Sample], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples' token ids right-padded with zeros, [B, T] on `device`, and their lengths [B] on the CPU."""
    fb = padded_rows(samples, (len(samples), max(len(s.input_ids) for s in samples)), device)
    return fb.input_ids, fb.lengths


class _StopForward(Exception):
    """Raised from the deepest needed layer's hook to skip the rest of the model."""


class TargetRunner:
    def __init__(
        self,
        target: Target,
        layer_ids: list[int],
        topk: int = 0,
        labels: bool = True,
        lm_head_chunk: int = 4096,
        fused: bool = True,
    ):
        if topk < 0 or (topk and not labels):
            raise ValueError("topk must be >= 0 and needs labels=True")
        self.target = target
        self.layer_ids = list(layer_ids)
        self.topk = topk
        self.labels = labels
        self.lm_head_chunk = lm_head_chunk
        self.fused = fused  # packed rows through target/fused.py's kernels where the target has them

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: Cache | None = None) -> TargetOutput:
        """input_ids: [B, T] right-padded on the model's device, one sample per row; lengths: [B].
        With a `cache` (one unpadded row), the tokens continue the ones it holds, and it keeps theirs."""
        lengths = lengths.cpu().long()
        rows = torch.arange(len(lengths))
        return self.run_batch(ForwardBatch(rows.tolist(), input_ids, lengths, rows, torch.zeros_like(rows)), cache)

    @torch.inference_mode()
    def run_batch(self, fb: ForwardBatch, cache: Cache | None = None) -> TargetOutput:
        """No attention mask is passed. Padded rows need none: with causal attention, and with the
        causal conv and recurrence of linear-attention layers, tokens after position t never change
        position t, so the padding tail cannot alter the real tokens. Packed rows carry their sample
        boundaries instead (target/varlen.py). Tests check both against each sample run alone.
        """
        input_ids = fb.input_ids
        batch, seq = input_ids.shape
        width = self.target.hidden_size
        hidden = torch.empty(batch, seq, len(self.layer_ids) * width, dtype=torch.bfloat16, device=input_ids.device)
        deepest = max(self.layer_ids)
        handles = []
        for slot, layer in enumerate(self.layer_ids):
            dest = hidden[..., slot * width : (slot + 1) * width]
            stop = not self.labels and layer == deepest
            handles.append(self.target.layers[layer].register_forward_hook(partial(self._store, dest, stop)))
        try:
            with ExitStack() as scope:
                if fb.cu_seqlens is not None:
                    scope.enter_context(packed_kernels(self.target.model))
                    if self.fused:
                        scope.enter_context(fused_kernels(self.target.model))
                out = self.target.base(
                    input_ids=input_ids,
                    **cache_kwargs(self.target.base, cache),
                    **fb.forward_kwargs(),
                )
        except _StopForward:
            out = None
        finally:
            for handle in handles:
                handle.remove()
        if not self.labels:
            return TargetOutput(hidden, None, None, None)
        return TargetOutput(hidden, *self._label(out.last_hidden_state, fb.real_tokens()))

    @staticmethod
    def _store(dest: torch.Tensor, stop: bool, module, args, output) -> None:
        # Decoder layers return a tensor in some models and a tuple (hidden, ...) in others.
        # Copy now: a later in-place op on the returned tensor must not reach the capture.
        dest.copy_(output[0] if isinstance(output, tuple) else output)
        if stop:
            raise _StopForward

    def _label(
        self, final: torch.Tensor, real_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Final-normed hidden [B, T, H] -> argmax ids (and top-k) at the real tokens (flat indices,
        on the CPU so the GPU never syncs for them), chunk by chunk, so at most [lm_head_chunk,
        vocab] logits exist at once."""
        batch, seq, width = final.shape
        device = final.device
        flat = to_device(real_tokens, device)
        tokens = final.reshape(batch * seq, width)
        head = self.target.model.get_output_embeddings()
        k = self.topk
        target_ids = torch.full((batch * seq,), -1, dtype=torch.long, device=device)
        topk_ids = torch.full((batch * seq, k), -1, dtype=torch.long, device=device) if k else None
        topk_logprobs = torch.zeros(batch * seq, k, dtype=torch.float32, device=device) if k else None
        for idx in flat.split(self.lm_head_chunk):
            logits = head(tokens.index_select(0, idx))
            target_ids[idx] = logits.argmax(-1)
            if k:
                values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
                topk_ids[idx] = ids
                topk_logprobs[idx] = values
        shape = (batch, seq)
        return (
            target_ids.view(shape),
            topk_ids.view(*shape, k) if k else None,
            topk_logprobs.view(*shape, k) if k else None,
        )
