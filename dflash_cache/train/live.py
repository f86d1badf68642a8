"""`LiveSource`: the target running in-process as the source of training batches.

It yields the very `FeatureBatch` the cache stream (`stream.loader.Loader`) yields for the same plan:
same samples in the same order, packed the same way, with the target's hidden states of the same
layers in bf16 and its argmax labels. So a run trains "live", as the coupled pipelines do, with every
line after the source shared with training from a cache, and a cache run can be checked against it.

Bit-for-bit equality with a cache needs the target to compute each sample the same way in both:
a bf16 forward's rounding depends on the batch it runs in (its shape picks the kernels). The rule:
by default LiveSource runs every sample alone, padded to its length bucket, as extraction does with
`--batching padded --token-budget 1` on the same device (the same BucketLayout builds both); so a `bf16-zstd` (lossless) cache extracted that way trains to identical losses.
`forward_tokens` instead packs a batch's samples into padded forwards (faster on a GPU; equal to a
cache only up to that rounding).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from dflash_cache.data.dataset import Sample
from dflash_cache.data.tokenized import tokenized_data
from dflash_cache.drafter.head import TargetHead
from dflash_cache.errors import DFlashCacheError
from dflash_cache.extract.buckets import BucketLayout
from dflash_cache.extract.spec import make_spec, tokenizer_hash
from dflash_cache.stream.batch import FeatureBatch
from dflash_cache.stream.caches import is_held_out
from dflash_cache.target.info import read_target_info
from dflash_cache.target.precision import forward_dtype
from dflash_cache.target.runner import TargetRunner, padded_batch
from dflash_cache.target.target import Target, load_target, resolve_layer_ids

LIVE_CODEC = "live"  # the `codec` of a live source's spec: hidden states are never encoded


def target_head(target: Target) -> TargetHead:
    """The frozen pieces a drafter shares, in bf16 as extraction writes them to `CACHE/target/`."""
    model = target.model
    weights = (model.get_input_embeddings().weight, target.base.norm.weight, model.get_output_embeddings().weight)
    return TargetHead(*(w.detach().to(torch.bfloat16) for w in weights))


class LiveSource:
    """Samples keyed as in a cache of the same data: key = sample id = the record's index (a cache
    that skipped bad samples has fewer keys, so its keys and these part ways after the first skip).

    Reading the target's config and tokenizing the data happen at construction; the weights load on
    the first call that needs them (`head`, `batches`). `target` may also be a Target already loaded
    (benchmarks build one in place): its folder then gives the config and tokenizer, its model the
    device."""

    def __init__(
        self,
        target: str | Path | Target,
        data: Sequence[str | Path],
        layers: list[int] | None = None,
        num_draft_layers: int | None = None,
        device: str | torch.device = "cpu",
        max_length: int = 8192,
        forward_tokens: int | None = None,
    ):
        if forward_tokens is not None and forward_tokens < 1:
            raise DFlashCacheError(f"forward_tokens must be positive (got {forward_tokens}).")
        built = target if isinstance(target, Target) else None
        self.info = read_target_info(built.path if built else target)
        self.layer_ids = resolve_layer_ids(self.info.num_layers, layers, num_draft_layers)
        self.device = built.model.device if built else torch.device(device)
        self.forward_tokens = forward_tokens
        self.alone = BucketLayout(token_budget=1, max_length=max_length)
        tokenizer = AutoTokenizer.from_pretrained(self.info.path, local_files_only=True)
        # The tokenized-data cache extraction uses: tokenized once (in parallel) and shared with `extract`
        # of the same data; samples are read from it when a batch needs them.
        tokenized = tokenized_data(list(data), tokenizer, max_length, tokenizer_hash(self.info.path))
        self.sample_ids: np.ndarray = tokenized.sample_ids  # by key
        self.samples: Mapping[int, Sample] = tokenized.samples(tokenized.sample_ids)  # by sample id
        self.lengths: list[int] = tokenized.lengths.tolist()
        self.spec = make_spec(
            self.info, self.layer_ids, LIVE_CODEC, tokenized.source_hash, max_length, topk=0, token_budget=None
        )
        self.width = len(self.layer_ids) * self.info.hidden_size
        self._runner: TargetRunner | None = TargetRunner(built, self.layer_ids) if built else None

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def head_dir(self) -> Path:
        """The target's own folder: its tokenizer files stand where a cache's `target/` has them."""
        return self.info.path

    def sample_id(self, key: int) -> int:
        return int(self.sample_ids[key])

    def describe(self, key: int) -> str:
        return f"sample {self.sample_id(key)}"

    def split(self, eval_fraction: float) -> tuple[list[int], list[int]]:
        """(train keys, held-out keys), chosen by sample id as for a cache."""
        train, held_out = [], []
        for key in range(len(self)):
            (held_out if is_held_out(self.sample_id(key), eval_fraction) else train).append(key)
        return train, held_out

    @property
    def runner(self) -> TargetRunner:
        if self._runner is None:
            target = load_target(self.info.path, self.device, forward_dtype(self.device))
            self._runner = TargetRunner(target, self.layer_ids)
        return self._runner

    def head(self, device: torch.device | str) -> TargetHead:
        return target_head(self.runner.target).to(device)

    def batches(self, plan: Sequence[Sequence[int]], device: torch.device | str) -> Iterator[FeatureBatch]:
        """The FeatureBatch of every batch of keys in `plan`, in order, on `device`."""
        for keys in plan:
            yield self.batch(keys, device)

    def batch(self, keys: Sequence[int], device: torch.device | str) -> FeatureBatch:
        samples = [self.samples[self.sample_id(k)] for k in keys]
        hidden, target_ids = [], []
        # The target's GPU may not be the current one (the drafter's, under `train --target-gpus`).
        with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
            for group in self._forwards(samples):
                if self.forward_tokens is None:
                    out = self.runner.run_batch(self.alone.build(group, self.device))
                else:
                    out = self.runner.run(*padded_batch(group, self.device))
                for b, n in enumerate(len(s.input_ids) for s in group):
                    hidden.append(out.hidden[b, :n])
                    target_ids.append(out.target_ids[b, :n])
        cu_seqlens = torch.zeros(len(samples) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int32).cumsum(0)
        return FeatureBatch(
            sample_ids=[s.sample_id for s in samples],
            input_ids=torch.from_numpy(np.concatenate([s.input_ids for s in samples]).astype(np.int64)),
            loss_mask=torch.from_numpy(np.concatenate([s.loss_mask for s in samples])),
            target_ids=torch.cat(target_ids),
            hidden=torch.cat(hidden),
            cu_seqlens=cu_seqlens,
        ).to(device)

    def _forwards(self, samples: list[Sample]) -> Iterator[list[Sample]]:
        """The samples of one target forward each: alone, or up to `forward_tokens` padded tokens."""
        if self.forward_tokens is None:
            yield from ([s] for s in samples)
            return
        group: list[Sample] = []
        for sample in samples:
            longest = max([len(s.input_ids) for s in group] + [len(sample.input_ids)])
            if group and (len(group) + 1) * longest > self.forward_tokens:
                yield group
                group = []
            group.append(sample)
        yield group

    def close(self) -> None:
        self._runner = None
