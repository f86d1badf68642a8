"""Greedy decoding of one left-padded batch, one token a step, its rows leaving as they finish.

The prompts are left-padded to one width; the attention mask and the position ids (counted from each
row's first real token) leave each row's answer the one greedy `generate` gives that row alone. A
row that has finished leaves the batch and its cache (`Cache.batch_select_indices`), so the others
no longer pay for it. Each cohort owns its cache, so a replica can step several in turn: requests
that arrive while a long answer runs start as a cohort of their own instead of waiting for it.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_cache.target.kvcache import cache_kwargs, returned_cache


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one batch padded on the left to the longest, and its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


class Cohort:
    @torch.inference_mode()
    def __init__(self, model: nn.Module, prompts: list[list[int]], pad_id: int, max_new: int, stops: set[int]):
        self.model, self.max_new, self.stops = model, max_new, stops
        device = next(model.parameters()).device
        ids, self.mask = left_padded(prompts, pad_id, device)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.rows: list[list[int]] = [[] for _ in prompts]
        self.alive = torch.arange(len(prompts), device=device)  # index in `prompts` of each row still in the batch
        self.out = model(
            input_ids=ids, attention_mask=self.mask, position_ids=self.positions, use_cache=True, logits_to_keep=1
        )
        self.cache = returned_cache(self.out)

    @property
    def size(self) -> int:
        """Rows still generating."""
        return len(self.alive)

    @torch.inference_mode()
    def step(self) -> list[tuple[int, list[int]]]:
        """Every live row's next token; returns the rows it finished, as (index in the prompts, answer
        tokens, end token included), and runs the others' forward for the step after."""
        tokens = self.out.logits[:, -1].argmax(-1)
        keep, finished = [], []
        for i, (row, token) in enumerate(zip(self.alive.tolist(), tokens.tolist())):
            self.rows[row].append(token)
            if token not in self.stops and len(self.rows[row]) < self.max_new:
                keep.append(i)
            else:
                finished.append((row, self.rows[row]))
        if len(keep) < len(self.alive):
            kept = torch.tensor(keep, dtype=torch.long, device=self.alive.device)
            self.alive, tokens, self.mask, self.positions = (
                self.alive[kept],
                tokens[kept],
                self.mask[kept],
                self.positions[kept],
            )
            if not keep:
                return finished
            self.cache.batch_select_indices(kept)
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        self.positions = self.positions[:, -1:] + 1
        self.out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=self.positions,
            logits_to_keep=1,
            **cache_kwargs(self.model, self.cache),
        )
        return finished
