"""A target larger than one device, split by transformers' own tensor parallelism under torchrun.

The processes of a launch form a group that holds one copy of the target, split over them by the
model's tensor-parallel plan; the group is one extraction rank: its first process writes, the
others compute beside it.

Several groups in one launch (data parallel across them) are refused: transformers builds its
device mesh over the whole launch, and its data-parallel replicas are FSDP modules, which neither
run under inference mode nor let the final norm and the LM head be called apart from the whole
model, as target/runner.py calls them ("Inference tensors do not track version counter", "FSDP
requires a single root module").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from dflash_cache.errors import DFlashCacheError

BF16_BYTES = 2
# Of a GPU's memory the weights may take: the rest holds a batch's activations (a 49,152-token forward).
WEIGHT_SHARE = 0.8
# Loading a split target takes each process through every weight file: far longer than a collective's default wait.
LAUNCH_TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class Group:
    """Where one torchrun process stands in the launch's tensor-parallel group."""

    member: int  # this process's place in the group; 0 writes
    size: int  # processes in the group (--tp)

    @property
    def writes(self) -> bool:
        return self.member == 0


def group_of(rank: int, world: int, tp: int) -> Group:
    if world != tp:
        raise DFlashCacheError(
            f"--tp {tp} with {world} processes: a launch holds one tensor-parallel copy of the target, "
            f"start torchrun with --nproc-per-node {tp} (one copy per launch; run the data in parts for more)"
        )
    return Group(rank, tp)


@dataclass(frozen=True)
class Weights:
    """A target's parameters: those its tensor-parallel plan splits over a group, those every process keeps whole."""

    split: int
    whole: int

    def per_process(self, tp: int) -> int:
        return self.whole + math.ceil(self.split / tp)


def plan_weights(model: torch.nn.Module, config) -> Weights:
    """Which of `model`'s parameters (a meta-device build of `config`) transformers' tensor-parallel plan
    (`base_model_tp_plan`) splits; the rest stay whole on each process (routed experts too, where a
    release lists them in its expert-parallel plan only)."""
    plan = getattr(config.get_text_config(), "base_model_tp_plan", None) or {}
    patterns = [
        re.compile(r"(^|\.)" + re.escape(key).replace(r"\*", r"\d+") + r"\.")
        for key, style in plan.items()
        if not style.startswith("replicated")
    ]
    split = whole = 0
    for name, parameter in model.named_parameters():
        if any(pattern.search(name) for pattern in patterns):
            split += parameter.numel()
        else:
            whole += parameter.numel()
    return Weights(split, whole)


def check_fits(weights: Weights, device_bytes: int, tp: int) -> None:
    """Refuse a target whose bf16 weights, as a process of a `tp` group holds them, leave too little of
    a device for extraction's batches; name the --tp that fits, or say that none does."""
    room = WEIGHT_SHARE * device_bytes
    if weights.per_process(tp) * BF16_BYTES <= room:
        return
    total = weights.split + weights.whole
    said = f"the target's {total / 1e9:.1f}B parameters take {total * BF16_BYTES / 2**30:.0f} GiB in bf16, "
    if tp > 1:
        said += f"{weights.per_process(tp) * BF16_BYTES / 2**30:.0f} GiB per process at --tp {tp}, "
    said += f"over {WEIGHT_SHARE:.0%} of a {device_bytes / 2**30:.0f} GiB GPU"
    if weights.whole * BF16_BYTES >= room:
        raise DFlashCacheError(
            f"{said}, and {weights.whole / 1e9:.1f}B of them (routed experts, embeddings, norms) are whole on every "
            "process whatever --tp: transformers' tensor-parallel plan does not split them; use GPUs with more memory"
        )
    needed = next(n for n in range(max(tp, 1), 1 << 16) if weights.per_process(n) * BF16_BYTES <= room)
    raise DFlashCacheError(f"{said}: split it with torchrun --nproc-per-node {needed} ... extract --tp {needed}")


def join_launch(device: str) -> None:
    """Wait until every process of the torchrun launch is here, starting torch.distributed's process
    group if it is not yet (transformers then loads the split target on it)."""
    if not dist.is_initialized():
        cuda = torch.device(device).type == "cuda"
        dist.init_process_group(
            "nccl" if cuda else "gloo", device_id=torch.device(device) if cuda else None, timeout=LAUNCH_TIMEOUT
        )
    dist.barrier()


def tensor_parallel_kwargs(group: Group) -> dict:
    """from_pretrained's arguments splitting the target over the group's processes."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # a transformers from before its native distributed loading
        return {"tp_plan": "auto", "tp_size": group.size}
    return {"distributed_config": DistributedConfig(tp_size=group.size)}


def load_split(path, dtype: torch.dtype, attention: str, group: Group):
    """The target's *ForCausalLM, this process's part of it on its own device."""
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention, local_files_only=True, **tensor_parallel_kwargs(group)
    )


def full(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole on every rank of its group (a collective for a split one: every rank calls it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
