"""Compile and autotune the target's kernels once, before the first real batch, and share them.

Triton (flash-linear-attention's kernels) and Inductor keep what they compile in disk caches:
Triton's default folder, or the one `--kernel-cache` names (it sets TRITON_CACHE_DIR and
TORCHINDUCTOR_CACHE_DIR for this run). A resumed run, a second extraction with the same target and
the other ranks on the node then load kernels instead of compiling and autotuning them again.

The ranks of a node warm up one at a time under a file lock in that folder: the first compiles,
the others find its kernels on disk, so five ranks never compile the same kernel at once.

Triton's autotuner compiles the configurations of a kernel one after the other, each before it is
timed: most of a cold minute on a hybrid target. During the warm-up each autotuner first compiles
all its configurations at once on a pool of threads (Triton's asynchronous compile mode), then
times each in ten runs instead of 125 ms of runs. That still compiles kernel after kernel, since
each kernel is timed before the forward goes on. So the side process below first runs a dry
forward in which no autotuned kernel launches and the configurations of every kernel compile
together on one pool (`compile_all_kernels_at_once`), then the forward that times them: on an
H200 this took a third off the whole warm-up against compiling kernel after kernel (benchmarks/warmup.py).
Compiling in a pool of processes instead of threads did no better there.

Compiling does not need the target's weights. For hybrid targets, whose linear-attention kernels
take about a minute to compile and autotune from an empty cache, `start_background_warmup` runs the
warm-up in a process of its own on a two-layer model of the target's shape (one layer of each
kind, random weights) while the main process tokenizes and loads the real target; the main
process's own warm-up then finds the kernels on disk.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from dflash_cache.target.batch import Layout
from dflash_cache.target.runner import TargetRunner
from dflash_cache.target.target import Target

# The CPU's warm-up row is cut into sequences of at most this many tokens, not packing's 2,048: nothing
# is compiled for their lengths there, and the CPU computes attention per sequence, at the square of its
# length (tests/test_demo.py's end-to-end test, run alternately with each: about half the time with 512).
# The warm-up row of a run with a token budget
# up to 512 is as it was in the runs where the first-forward difference was seen and cured (the resume
# tests, a budget of 300; docs/FAULTS.md, "Not covered").
CPU_WARMUP_SEQUENCE = 512


def use_kernel_cache(folder: Path | None) -> Path:
    """Point the compilers' disk caches at `folder` (None: keep TRITON_CACHE_DIR or Triton's
    default); returns the folder in use."""
    if folder is not None:
        folder = Path(folder).expanduser().resolve()
        os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
        return folder
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


@contextmanager
def node_lock(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "dflash-cache-warmup.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def _autotuners_patched(threads: int, make_run) -> Iterator[tuple[type, _CompileAndBuildLauncher] | None]:
    """While active, Triton's Autotuner.run is `make_run(the original run, AsyncCompileMode, compiler)`,
    `compiler` handing compilations to a pool of `threads`; yields (AsyncCompileMode, compiler), or
    None, patching nothing, with a Triton that has no asynchronous compile mode."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        yield None
        return
    run = Autotuner.run
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool:
        compiler = _CompileAndBuildLauncher(pool)
        Autotuner.run = make_run(run, AsyncCompileMode, compiler)
        try:
            yield AsyncCompileMode, compiler
        finally:
            Autotuner.run = run


@contextmanager
def parallel_autotune(threads: int) -> Iterator[None]:
    """While active, a Triton autotuner compiles all its configurations on `threads` threads before
    timing them, for a shorter time each (a no-op with a Triton that has no asynchronous compile mode).
    An autotuner whose choice is already known (in memory, or in the disk cache: the side process
    or an earlier run tuned it) compiles only the chosen configuration, as Triton does."""

    def make_run(run, AsyncCompileMode, compiler):
        def compile_all_then_run(self, *args, **kwargs):
            if len(self.configs) <= 1:
                return run(self, *args, **kwargs)
            self.__dict__["_bench"] = _refuse_to_time
            try:
                return run(self, *args, **kwargs)
            except _NotTuned:
                pass
            finally:
                del self.__dict__["_bench"]
            try:
                with AsyncCompileMode(compiler, ignore_errors=True):  # a configuration that fails is timed as failing
                    self.warmup(*args, **{k: v for k, v in kwargs.items() if k != "warmup"})
            except Exception:  # noqa: BLE001 - losing the head start only costs time: `run` compiles what is missing
                pass
            self.__dict__["do_bench"] = time_by_count
            try:
                return run(self, *args, **kwargs)
            finally:
                del self.__dict__["do_bench"]

        return compile_all_then_run

    with _autotuners_patched(threads, make_run):
        yield


TIMED_RUNS = 10


def time_by_count(fn, quantiles=(0.5, 0.2, 0.8), **_) -> list[float]:
    """Triton's autotuner benchmark by count instead of by time: one run to warm up, then these
    quantiles (ms) of TIMED_RUNS. Triton's do_bench runs a kernel for 25 + 100 ms, with a 256 MB
    cache flush before each run: a 0.1 ms kernel of a packed row hundreds of times, mostly flush
    and launch overhead, seconds in all over a hybrid target's configurations. The rows' tensors are far larger than the cache, so the flush
    changes little but the time it takes."""
    fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(TIMED_RUNS)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return [times[min(len(times) - 1, int(q * len(times)))] for q in quantiles]


class _CompileAndBuildLauncher:
    """An executor for Triton's asynchronous compile mode that also builds each new kernel
    signature's launcher on the compiling thread. Triton 3.6 builds the launcher, a small C module
    (gcc, kept in its disk cache), at a kernel's first launch, so otherwise one after the other on
    the thread that launches."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool, self.signatures, self.lock = pool, set(), threading.Lock()

    def submit(self, compile_kernel):
        return self.pool.submit(self._compile, compile_kernel)

    def _compile(self, compile_kernel):
        from triton.runtime import driver

        kernel = compile_kernel()
        signature = repr((list(kernel.src.signature.items()), getattr(kernel.metadata, "tensordesc_meta", None)))
        with self.lock:
            new = signature not in self.signatures
            self.signatures.add(signature)
        if new:
            try:
                driver.active.launcher_cls(kernel.src, kernel.metadata)
            except Exception:  # noqa: BLE001 - only a head start: the first launch builds it
                pass
        return kernel


class _NotTuned(Exception):
    pass


def _refuse_to_time(*args, **kwargs):
    raise _NotTuned  # Triton asked to time a configuration: no choice is known for this key


@contextmanager
def compile_all_kernels_at_once(threads: int) -> Iterator[None]:
    """While active, a forward launches no autotuned Triton kernel: each autotuner hands the
    compilation of all its configurations to one pool of `threads` and returns; leaving waits for
    all of them. Under `parallel_autotune` alone a kernel's configurations compile together, but
    kernel after kernel, since each is timed before the forward goes on; this lets every kernel of
    the forward compile at once. The forward's outputs are garbage (the next forward times the
    compiled configurations); shapes and sample boundaries come from the inputs, not from kernel
    outputs, so the dry forward reaches the kernels, and the specialisations, of a real one."""

    def submit_only(self, *args, **kwargs):
        self.warmup(*args, **{k: v for k, v in kwargs.items() if k != "warmup"})

    with _autotuners_patched(threads, lambda run, AsyncCompileMode, compiler: submit_only) as triton:
        if triton is None:
            yield
            return
        AsyncCompileMode, compiler = triton
        with AsyncCompileMode(compiler, ignore_errors=True):  # one that fails is timed as failing later
            yield


def compile_threads() -> int:
    return max(1, min(32, len(os.sched_getaffinity(0))))


def warm_up(
    runner: TargetRunner, layout: Layout, device: torch.device | str, folder: Path, one_rank_at_a_time: bool = True
) -> float:
    """Run the layout's warm-up forward, if it has one; returns its seconds. `one_rank_at_a_time`
    False: the ranks of a tensor-parallel group, whose forwards wait for each other, warm up together."""
    cpu = torch.device(device).type != "cuda"
    samples = layout.warmup_samples(CPU_WARMUP_SEQUENCE) if cpu else layout.warmup_samples()
    if not samples:
        return 0.0
    if cpu:
        # Nothing to compile, but under load a CPU process's first forward has come out different from
        # every later one (docs/FAULTS.md, "Not covered"): it runs on dummy rows, its outputs dropped.
        started = time.perf_counter()
        own = TargetRunner(runner.target, runner.layer_ids, topk=runner.topk, fused=runner.fused)
        own.run_batch(layout.build(samples, device))
        return time.perf_counter() - started
    with node_lock(folder) if one_rank_at_a_time else nullcontext(), parallel_autotune(compile_threads()):
        started = time.perf_counter()
        reach_every_kernel(runner, layout.build(samples, device))
        torch.cuda.synchronize(device)
        return time.perf_counter() - started


def reach_every_kernel(runner: TargetRunner, batch) -> None:
    """The forward of `batch` up to the first layer of each kind, where it stops: the later layers
    run the same kernels on the same shapes. The final norm and LM head are left out too: their
    kernels are those of the layers' norms, and torch's matmul."""
    kinds = getattr(runner.target.config, "layer_types", None) or ["decoder"]
    last = max(kinds.index(kind) for kind in set(kinds))
    TargetRunner(runner.target, [last], labels=False, fused=runner.fused).run_batch(batch)


def start_background_warmup(
    target_path: Path, layout: Layout, device: str, kernel_cache: Path | None, config
) -> multiprocessing.process.BaseProcess | None:
    """A daemon process compiling the kernels of `layout` for a hybrid target of `config` (its text
    config) on `device`; None where there is nothing worth compiling ahead (dense targets use
    precompiled attention kernels; the CPU compiles nothing)."""
    layer_types = getattr(config, "layer_types", None) or []
    if "linear_attention" not in layer_types or not layout.warmup_samples() or torch.device(device).type != "cuda":
        return None
    process = multiprocessing.get_context("spawn").Process(
        target=warm_up_small_model, args=(target_path, layout, device, kernel_cache), name="kernel-warmup", daemon=True
    )
    process.start()
    return process


def warm_up_small_model(target_path: Path, layout: Layout, device: str, kernel_cache: Path | None) -> None:
    """What the side process runs: build the small model, compile every kernel at once, time them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = use_kernel_cache(kernel_cache)
    config = AutoConfig.from_pretrained(target_path, local_files_only=True).get_text_config()
    kinds = list(dict.fromkeys(config.layer_types))  # one layer of each kind, in the target's order
    config.layer_types, config.num_hidden_layers = kinds, len(kinds)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=layout.attention)
    model.eval().requires_grad_(False)
    small = Target(
        path=Path(target_path),
        model=model,
        tokenizer=None,
        config=config,
        num_layers=len(kinds),
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        config_hash="",
        attention=layout.attention,
    )
    runner, batch, threads = TargetRunner(small, [0]), layout.build(layout.warmup_samples(), device), compile_threads()
    with node_lock(folder):
        started = time.perf_counter()
        with compile_all_kernels_at_once(threads):
            runner.run_batch(batch)
        torch.cuda.synchronize(device)
        compiled = time.perf_counter() - started
        with parallel_autotune(threads):  # compiles nothing new: times them
            runner.run_batch(batch)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
    print(
        f"kernels compiled and autotuned ahead, on a {len(kinds)}-layer model of the target's shape: {seconds:.1f} s "
        f"({compiled:.1f} s compiling every kernel at once, {seconds - compiled:.1f} s timing)",
        file=sys.stderr,
        flush=True,
    )
