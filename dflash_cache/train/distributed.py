"""Process model of a training run: one process per GPU (or a few on the CPU), DDP between them.

Three ways in:
- under `torchrun` (RANK / WORLD_SIZE / LOCAL_RANK set): this process is one rank; torchrun tears
  the others down when it dies;
- several GPUs (or several CPU processes): `launch` spawns one child per rank and watches them; the first
  failure kills every other child (SIGTERM, then SIGKILL) and is raised here with its message;
- otherwise a single process, no process group.

Collectives time out after `collective_timeout_s`, so a rank stuck without dying cannot hang the
others forever; a dead rank is seen at once by the launcher (or torchrun).
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import signal
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from dflash_cache.errors import DFlashCacheError

GRACE_S = 3.0  # after a failure, how long other ranks get to exit before SIGTERM, then SIGKILL


@dataclass
class Rank:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class RankFailed(RuntimeError):
    """A spawned rank raised an unexpected exception; the message names the rank and the cause."""


def visible_gpus() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def plan_devices(gpus: list[int] | None, cpu_procs: int) -> list[str]:
    """The device of each rank this machine runs: 'cuda:i' per GPU, or 'cpu' per CPU process."""
    if cpu_procs:
        return ["cpu"] * cpu_procs
    if gpus is None:
        gpus = visible_gpus()
    if gpus:
        available = visible_gpus()
        if missing := [g for g in gpus if g not in available]:
            raise DFlashCacheError(f"--gpus names GPUs {missing} but this machine has {len(available)} visible GPU(s)")
        return [f"cuda:{g}" for g in gpus]
    return ["cpu"]


def init_rank(rank: int, world: int, device: str, timeout_s: float) -> Rank:
    """Join the process group (when world > 1) and pick this rank's device."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return Rank(rank, world, device)


def shutdown() -> None:
    if dist.is_initialized():
        # unreachable objects first: after Muon's broadcasts, some freed only at exit, after the group, made
        # gloo abort about one exit in ten ("terminate called without an active exception")
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def is_first_rank() -> bool:
    """Rank 0 of the process group, or a process without one."""
    return not dist.is_initialized() or dist.get_rank() == 0


def all_gather_objects(obj) -> list:
    """`obj` of every rank, in rank order (a collective: every rank must call it)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this child if the launcher dies, so no orphan keeps a GPU."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child(index: int, fn: Callable, devices: list[str], port: int, errors, args: tuple) -> None:
    _die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        fn(index, len(devices), devices[index], *args)
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the launcher, then exits
        user_error = isinstance(e, DFlashCacheError)
        message = str(e) if user_error else f"{type(e).__name__}: {e}"
        errors.put((index, user_error, message, traceback.format_exc()))
        os._exit(1)  # no atexit hooks: a thread stuck in a read must not keep the process alive


def launch(fn: Callable, devices: list[str], args: tuple = ()) -> None:
    """Run `fn(rank, world, device, *args)` once per device: in this process for one device,
    else in spawned children. Raises the first child failure (DFlashCacheError stays one)."""
    if len(devices) == 1:
        fn(0, 1, devices[0], *args)
        return
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = mp.start_processes(
        _child, args=(fn, devices, free_port(), errors, args), nprocs=len(devices), join=False, start_method="spawn"
    )
    try:
        while not procs.join(timeout=1.0, grace_period=GRACE_S):
            pass
    except ProcessException as e:
        if (
            getattr(e, "signal_name", None) or errors.empty()
        ):  # a rank killed from outside: the others' errors follow from it
            raise RankFailed(f"rank {e.error_index} died ({e}) without reporting an error") from None
        rank, user_error, message, trace = errors.get()  # the first to fail: others fail after it exits
        error = (DFlashCacheError if user_error else RankFailed)(f"rank {rank}: {message}")
        error.add_note(f"traceback of rank {rank}:\n{trace}")  # shown with --debug
        raise error from None
    except BaseException:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
        raise
