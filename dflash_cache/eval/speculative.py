"""`evaluate_speculative`: a drafter with its target on held-out prompts, checked against greedy.

For every prompt the target decodes twice: speculatively with the drafter (decode.py) and plainly
greedy with its KV cache. The two outputs must be equal token for token, or the evaluation stops
with an error naming the prompt and the first differing token. Where the speculative decoding runs
on the KV cache too (a target whose cache can be cut back, target/kvcache.py), the two wall times compare
like with like and their ratio is the speed-up; elsewhere no speed-up is claimed.

The target runs in float32 by default. Equality is exact math, but the two decodings run the target
on different shapes (a block of B tokens vs one token), which sum in different orders; in bf16 that
moves logits by about 1%, enough to flip the argmax where the top two nearly tie, which would make
the check fail for reasons unrelated to decoding (with the demo's bf16 target it fails on the fourth
held-out prompt, at a logit gap of 0.03). In fp32 such flips need a tie within ~1e-6.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_cache.choices import TARGET_DTYPES
from dflash_cache.errors import DFlashCacheError
from dflash_cache.eval.decode import (
    Generation,
    block_drafter,
    greedy_generate,
    speculative_generate,
)
from dflash_cache.eval.drafters import build_drafter, check_fits, read_drafter
from dflash_cache.eval.prompts import load_prompts
from dflash_cache.target.kvcache import croppable
from dflash_cache.target.runner import TargetRunner
from dflash_cache.target.target import Target, load_target
from dflash_cache.train.budget import is_out_of_memory
from dflash_cache.train.live import target_head

DTYPES = {name: getattr(torch, name) for name in TARGET_DTYPES}
# (prompts, new tokens per prompt) by device type: a CPU affords fewer and shorter decodings.
DEFAULTS = {"cuda": (16, 128), "cpu": (8, 64)}


def speculative_defaults(device: str | None) -> tuple[int, int]:
    return DEFAULTS.get(default_device(device).type, DEFAULTS["cpu"])


@dataclass
class SpeculativeOptions:
    drafter: Path
    target: Path
    data: list[Path]
    max_new_tokens: int = 128
    num_prompts: int | None = 16  # None: every record with a prompt
    device: str | None = None  # None: cuda:0 when there is a GPU, else the CPU
    dtype: str = "float32"


@dataclass
class SpeculativeReport:
    drafter: Path  # the checkpoint folder the drafter came from
    block_size: int
    prompts: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # speculative, prompt forwards included
    accepted: list[int] = field(default_factory=list)  # accepted drafts of every cycle
    speculative_s: float = 0.0
    greedy_s: float = 0.0
    kv_cached: bool = True  # speculative verification on the KV cache (else: each cycle recomputes the sequence)

    @property
    def cycles(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens a drafting cycle yields: accepted drafts plus the target's own token."""
        return 1 + sum(self.accepted) / max(self.cycles, 1)

    @property
    def acceptance(self) -> list[float]:
        """Per draft position k = 1 .. B-1: the share of cycles that accepted drafts 1..k (these sum to tau - 1)."""
        return [sum(m >= k for m in self.accepted) / max(self.cycles, 1) for k in range(1, self.block_size)]

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per target forward (plain greedy decoding: 1)."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def speedup(self) -> float:
        """Wall-clock speed-up of speculative over KV-cached greedy decoding of the same prompts."""
        return self.greedy_s / max(self.speculative_s, 1e-9)

    def add(self, generation: Generation, seconds: float) -> None:
        self.prompts += 1
        self.new_tokens += len(generation.tokens)
        self.target_forwards += generation.target_forwards
        self.accepted += generation.accepted
        self.speculative_s += seconds

    def lines(self) -> list[str]:
        per_position = " ".join(f"{a:.2f}" for a in self.acceptance)
        return [
            f"{self.prompts} prompts, {self.new_tokens} new tokens, every output equal to the target's greedy output",
            f"tau (mean acceptance length) {self.tau:.2f} over {self.cycles} drafting cycles (block size {self.block_size})",
            f"tokens per target forward {self.tokens_per_forward:.2f} (greedy: 1.00)",
            f"acceptance per draft position 1..{self.block_size - 1}: {per_position}",
            (
                f"wall time: speculative {self.speculative_s:.1f} s, KV-cached greedy {self.greedy_s:.1f} s: "
                f"speed-up {self.speedup:.2f}x"
                if self.kv_cached
                else f"wall time: speculative {self.speculative_s:.1f} s, greedy {self.greedy_s:.1f} s; no speed-up measured: "
                "this target's cache cannot be cut back after a rejected draft (linear-attention layers keep no state "
                "snapshots), so each cycle recomputes the whole sequence"
            ),
            "this tau is the drafter guessing the target's own greedy answers; the offline tau (eval --cache) scores "
            "it on the data's text, so the two differ when the data's answers are not ones this target would give "
            "(training on answers regenerated by the target closes the gap)",
        ]


def stop_ids(target: Target) -> set[int]:
    """End-of-turn tokens: the tokenizer's eos and those of the target's generation config."""
    ids = {target.tokenizer.eos_token_id}
    configured = getattr(target.model.generation_config, "eos_token_id", None)
    ids |= set(configured) if isinstance(configured, list) else {configured}
    return {int(i) for i in ids if i is not None}


def default_device(device: str | None) -> torch.device:
    """`--device`, checked before anything is loaded; None: cuda:0 when there is a GPU, else the CPU."""
    if device is None:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise DFlashCacheError(f"--device {device!r} is not a device (cpu, cuda or cuda:N)") from None
    if chosen.type == "cuda" and (chosen.index or 0) >= torch.cuda.device_count():
        raise DFlashCacheError(
            f"--device {device}: there is no such GPU (this machine shows "
            f"{torch.cuda.device_count()} GPU(s)); pick one of those or cpu"
        )
    if chosen.type not in ("cpu", "cuda"):
        raise DFlashCacheError(f"--device {device!r} is not a device (cpu, cuda or cuda:N)")
    return chosen


def evaluate_speculative(
    opts: SpeculativeOptions, on_prompt: Callable[[int, int], None] = lambda done, total: None
) -> SpeculativeReport:
    if opts.dtype not in DTYPES:
        raise DFlashCacheError(f"unknown dtype {opts.dtype!r}; use one of {list(DTYPES)}.")
    if opts.max_new_tokens < 1:
        raise DFlashCacheError(f"--max-new-tokens must be at least 1 (got {opts.max_new_tokens}).")
    device = default_device(opts.device)
    config, state, source = read_drafter(opts.drafter)
    target = load_target(opts.target, device, DTYPES[opts.dtype])
    check_fits(config, target.hidden_size, target.vocab_size, target.num_layers)
    # One block of B queries per cycle: the dense mask is tiny, and it needs no flex-attention kernel.
    drafter = build_drafter(config, state, target_head(target), device, attention="dense")
    prompts = load_prompts(opts.data, target.tokenizer, opts.num_prompts)
    runner = TargetRunner(target, config.target_layer_ids)
    draft, stops = block_drafter(drafter), stop_ids(target)
    report = SpeculativeReport(source, config.block_size, kv_cached=croppable(target.config))
    on_prompt(0, len(prompts))
    for i, prompt in enumerate(prompts):
        started = time.perf_counter()
        try:
            generation = speculative_generate(
                runner, draft, config.block_size, prompt, opts.max_new_tokens, stops, report.kv_cached
            )
            middle = time.perf_counter()
            greedy = greedy_generate(target.model, prompt, opts.max_new_tokens, stops)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            raise DFlashCacheError(
                f"out of memory on {device} decoding prompt {i} ({len(prompt):,} tokens + up to {opts.max_new_tokens:,} "
                f"new ones, one sequence at a time); lower --max-new-tokens (now {opts.max_new_tokens:,}) or pass "
                "--data with shorter prompts"
            ) from None
        report.greedy_s += time.perf_counter() - middle
        check_equal(target, i, prompt, generation.tokens, greedy.tokens)
        report.add(generation, middle - started)
        on_prompt(i + 1, len(prompts))
    return report


def check_equal(target: Target, index: int, prompt: list[int], speculative: list[int], greedy: list[int]) -> None:
    if speculative == greedy:
        return
    at = next((i for i, (s, g) in enumerate(zip(speculative, greedy)) if s != g), min(len(speculative), len(greedy)))
    if at == min(len(speculative), len(greedy)):
        raise DFlashCacheError(
            f"prompt {index}: speculative decoding gave {len(speculative)} tokens, greedy decoding {len(greedy)}; "
            "the outputs must be equal (a decoding bug)."
        )
    with torch.inference_mode():
        ids = torch.tensor([prompt + greedy[:at]], device=target.model.device)
        logits = target.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    gap = float(logits[greedy[at]] - logits[speculative[at]])
    raise DFlashCacheError(
        f"prompt {index}: speculative decoding differs from greedy decoding at new token {at} "
        f"({speculative[at]} vs {greedy[at]}; the target's logits for them differ by {gap:.2e}: a gap near 0 is a "
        "floating-point near-tie, which a float32 target makes rare; anything else is a decoding bug)."
    )
