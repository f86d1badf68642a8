"""Greedy decoding of a target, plain and speculative with a block drafter.

Speculative decoding, one cycle:

    tokens x_0 .. x_a            x_a is the newest token: the target has not run on it yet
    context features h_0 .. h_{a-1}   the target's captured layers at every earlier position
    draft   d_1 .. d_{B-1} = drafter(block [x_a, mask, ...], context)       (a training block at anchor a)
    verify  one target forward over x_0 .. x_a, d_1 .. d_{B-1}: its argmax t_k at position a+k
    accept  d_1 .. d_m while d_k == t_{k-1}, then the target's own token t_m (the correction)

so a cycle yields m+1 tokens for one target forward, and every yielded token is the target's argmax
after the tokens before it: the output is the target's greedy output.

Where the target's KV cache can be cut back (every layer plain attention, target/kvcache.py), a cycle's
verifying forward runs only the block x_a, d_1 .. d_{B-1} against the cache, which then drops the
rejected drafts; the drafter's context features are those of each forward's kept positions. Where
it cannot (the recurrent state of hybrid linear-attention targets cannot drop a rejected suffix), the
verifying forward recomputes the whole sequence: correct for every architecture, but O(length) per
cycle instead of O(block), so its wall time says nothing about speed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.target.kvcache import cache_kwargs, crop_cache, new_cache, returned_cache
from dflash_cache.target.precision import drafter_autocast
from dflash_cache.target.runner import TargetRunner

# (tokens [a+1] int64 ending with the newest token, context features [a, L*H] bf16) -> drafts [B-1] int64
Drafter = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Generation:
    tokens: list[int]  # the new tokens, ending at the first stop token or at the token limit
    accepted: list[int] = field(default_factory=list)  # accepted drafts of each cycle (before the limit cut)
    target_forwards: int = 0  # the prompt's forward included


def _finished(tokens: list[int], stop_ids: set[int], max_new_tokens: int) -> bool:
    return len(tokens) >= max_new_tokens or (bool(tokens) and tokens[-1] in stop_ids)


def _until_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def greedy_generate(model, prompt: list[int], max_new_tokens: int, stop_ids: set[int]) -> Generation:
    """The target's own greedy output: one token per forward, with its KV cache."""
    device = model.get_input_embeddings().weight.device
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
    cache = returned_cache(out)  # the model's own kind of cache (hybrid targets keep recurrent state in it)
    tokens = [int(out.logits[0, -1].argmax())]
    while not _finished(tokens, stop_ids, max_new_tokens):
        step = torch.tensor([[tokens[-1]]], device=device)
        out = model(input_ids=step, logits_to_keep=1, **cache_kwargs(model, cache))
        tokens.append(int(out.logits[0, -1].argmax()))
    return Generation(tokens, target_forwards=len(tokens))


@torch.inference_mode()
def speculative_generate(
    runner: TargetRunner,
    draft: Drafter,
    block_size: int,
    prompt: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
    kv_cache: bool = False,
) -> Generation:
    """Greedy speculative decoding; `runner` must capture the layers the drafter reads. `kv_cache`:
    verify against the target's cache, cut back after each cycle (only where kvcache.croppable)."""
    device = runner.target.model.get_input_embeddings().weight.device
    cache = new_cache(runner.target.model) if kv_cache else None
    sequence = torch.tensor(prompt, device=device)
    out = runner.run(sequence[None], torch.tensor([len(prompt)]), cache)
    features, predicted = out.hidden[0], out.target_ids[0]
    generation = Generation([int(predicted[-1])], target_forwards=1)
    while not _finished(generation.tokens, stop_ids, max_new_tokens):
        sequence = torch.cat([sequence, predicted[-1:]])  # x_a: the target's newest token
        a = sequence.shape[0] - 1
        drafts = draft(sequence, features[:a]).to(device)
        first = a if cache is None else 0  # where x_a is in the verifying forward
        block = torch.cat([sequence[a - first :], drafts])
        out = runner.run(block[None], torch.tensor([block.shape[0]]), cache)
        generation.target_forwards += 1
        verdict = out.target_ids[0, first:]  # t_0 .. t_{B-1}: the target's token after x_a, d_1, ...
        m = int((drafts == verdict[:-1]).long().cumprod(0).sum())
        new = _until_stop(drafts[:m].tolist() + [int(verdict[m])], stop_ids)
        generation.accepted.append(min(m, len(new)))
        generation.tokens += new
        # The features of x_a and the accepted drafts are final; the next cycle drafts after them.
        sequence = torch.cat([sequence, drafts[:m]])
        if cache is None:
            features = out.hidden[0]
        else:
            crop_cache(cache, block_size - 1 - m)  # the rejected drafts
            features = torch.cat([features, out.hidden[0, : m + 1]])
        predicted = verdict[m : m + 1]
    del generation.tokens[max_new_tokens:]
    return generation


def block_drafter(drafter: DFlashDrafter) -> Drafter:
    """A DFlash drafter as a `Drafter`: the block at the newest token, its context every earlier one.

    The drafter runs as in training (bf16 autocast, one block at an anchor whose context is every
    earlier position of the sequence); the newest token's own features, unknown yet, are never seen
    (a block attends to context strictly before its anchor), so they are left as zeros."""
    lm_head = drafter.head.lm_head
    device = lm_head.device

    def draft(tokens: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        hidden = torch.cat([context, context.new_zeros(1, context.shape[1])]).to(device)
        inputs = DraftInputs(
            input_ids=tokens.to(device),
            loss_mask=torch.zeros(n, dtype=torch.bool, device=device),
            target_ids=torch.zeros(n, dtype=torch.long, device=device),
            hidden=hidden,
            positions=torch.arange(n, device=device),
            seq_ids=torch.zeros(n, dtype=torch.long, device=device),
            anchors=torch.tensor([n - 1], device=device),
        )
        with drafter_autocast(device):
            states = drafter.block_states(inputs)[0, 1:]  # slots 1 .. B-1
        return (states.to(lm_head.dtype) @ lm_head.T).float().argmax(-1)

    return draft
