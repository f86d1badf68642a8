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


def check_fits(parameters: int, device_bytes: int, tp: int) -> None:
    """Refuse a target whose bf16 weights, split over `tp` devices, leave too little of each for
    extraction's batches; name the --tp that fits."""
    needed = math.ceil(parameters * BF16_BYTES / (WEIGHT_SHARE * device_bytes))
    if needed > tp:
        raise DFlashCacheError(
            f"the target's {parameters / 1e9:.1f}B parameters take {parameters * BF16_BYTES / 2**30:.0f} GiB in bf16, "
            f"{'' if tp == 1 else f'{parameters * BF16_BYTES / tp / 2**30:.0f} GiB per process at --tp {tp}, '}"
            f"over {WEIGHT_SHARE:.0%} of a {device_bytes / 2**30:.0f} GiB GPU: split it with "
            f"torchrun --nproc-per-node {needed} ... extract --tp {needed}"
        )


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
