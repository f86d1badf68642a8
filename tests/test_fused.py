"""target/fused.py's kernels against HF's own qwen3_5 modules, and the warm-up's parallel autotuning."""

import importlib

import numpy as np
import pytest
import torch

from dflash_cache.data.dataset import Sample
from dflash_cache.extract.packing import PackedLayout
from dflash_cache.target.fused import fusable, fused_kernels
from dflash_cache.target.runner import TargetRunner
from dflash_cache.target.target import load_target
from dflash_cache.target.varlen import ATTENTION
from dflash_cache.target.warmup import compile_all_kernels_at_once, parallel_autotune, time_by_count
from tests.tiny import build_target

QWEN3_5 = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
CLASSES = (QWEN3_5.Qwen3_5RMSNorm, QWEN3_5.Qwen3_5RMSNormGated, QWEN3_5.Qwen3_5MLP, QWEN3_5.Qwen3_5GatedDeltaNet)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


def test_cpu_targets_keep_hf_modules(hybrid_dir):
    target = load_target(hybrid_dir, "cpu", torch.float32, attention=ATTENTION)
    before = [cls.forward for cls in CLASSES]
    assert not fusable(target.model)
    with fused_kernels(target.model):
        assert [cls.forward for cls in CLASSES] == before


def _samples(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(i, torch.randint(0, vocab, (n,), generator=g).numpy().astype(np.int32), np.ones(n, dtype=bool))
        for i, n in enumerate(lengths)
    ]


@pytest.mark.gpu
def test_fused_packed_rows_match_hf_modules(hybrid_dir):
    """The same packed row with fused kernels and with HF's modules (both respecting boundaries),
    and the fused row against each sample run alone through HF."""
    target = load_target(hybrid_dir, "cuda", torch.bfloat16, attention=ATTENTION)
    assert fusable(target.model)
    samples = _samples([70, 5, 33, 130, 64, 200], target.vocab_size)
    fb = PackedLayout(512).build(samples, "cuda")
    layers = [0, 2, 5]
    fused = TargetRunner(target, layers, fused=True).run_batch(fb)
    before = [cls.forward for cls in CLASSES]
    with fused_kernels(target.model):
        assert all(cls.forward is not forward for cls, forward in zip(CLASSES, before))
    assert [cls.forward for cls in CLASSES] == before  # restored on exit
    plain = TargetRunner(target, layers, fused=False).run_batch(fb)
    real = sum(len(s.input_ids) for s in samples)
    torch.testing.assert_close(fused.hidden[0, :real].float(), plain.hidden[0, :real].float(), atol=3e-2, rtol=3e-2)
    assert not torch.equal(fused.hidden[0, :real], plain.hidden[0, :real])  # the fused kernels did run
    agree = (fused.target_ids[0, :real] == plain.target_ids[0, :real]).float().mean().item()
    assert agree > 0.97
    reference = load_target(hybrid_dir, "cuda", torch.bfloat16)
    for sample, start in zip(samples, fb.starts.tolist()):
        n = len(sample.input_ids)
        ids = torch.from_numpy(sample.input_ids.astype(np.int64))[None].cuda()
        with torch.inference_mode():
            alone = reference.model(input_ids=ids, output_hidden_states=True)
        for slot, layer in enumerate(layers[:2]):
            torch.testing.assert_close(
                fused.hidden[0, start : start + n, slot * 64 : (slot + 1) * 64].float(),
                alone.hidden_states[layer + 1][0].float(),
                atol=3e-2,
                rtol=3e-2,
            )


def _autotuned_kernels(cache_results: bool = False):
    """Two chained elementwise kernels, each with 9 configurations: (y = 2x, z = y + 1); with
    `cache_results`, the first one's choice is kept in Triton's disk cache, as fla's are."""
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b in (64, 128, 256) for w in (1, 2, 4)]

    @triton.autotune(configs=configs, key=["n"], cache_results=cache_results)
    @triton.jit
    def double(x, y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + offs, tl.load(x + offs, mask=offs < n) * 2, mask=offs < n)

    @triton.autotune(configs=configs, key=["n"])
    @triton.jit
    def add_one(y, z, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(z + offs, tl.load(y + offs, mask=offs < n) + 1, mask=offs < n)

    def grid(meta, n):
        return (triton.cdiv(n, meta["BLOCK"]),)

    def launch_double(x, y):
        double[lambda meta: grid(meta, x.numel())](x, y, x.numel())

    def launch_both(x, y, z):
        launch_double(x, y)
        add_one[lambda meta: grid(meta, x.numel())](y, z, x.numel())

    return len(configs), launch_double, launch_both


def _count_compiles():
    import triton

    compiled = []
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled.append(1)
    return compiled


@pytest.mark.gpu
@pytest.mark.own_autotuning
def test_parallel_autotune_compiles_every_configuration_and_keeps_the_result():
    import triton

    configs, launch_double, _ = _autotuned_kernels()
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    compiled = _count_compiles()
    try:
        with parallel_autotune(4):
            launch_double(x, y)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    torch.testing.assert_close(y, x * 2)
    assert len(compiled) == configs  # each configuration compiled once, none twice


@pytest.mark.gpu
@pytest.mark.own_autotuning
def test_timing_by_count_picks_the_fast_configuration():
    import triton
    import triton.language as tl

    # 16-element programs (a million of them) against 1024-element ones, the slow one listed first.
    configs = [triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 1024}, num_warps=4)]

    @triton.autotune(configs=configs, key=["n"])
    @triton.jit
    def copy(x, y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)

    x = torch.randn(1 << 24, device="cuda")
    y = torch.empty_like(x)
    with parallel_autotune(2):
        copy[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, y, x.numel())
    torch.testing.assert_close(y, x)
    assert copy.best_config.kwargs["BLOCK"] == 1024
    slow, fast = (
        time_by_count(
            lambda c=c: copy.fn.run(
                x, y, x.numel(), grid=(triton.cdiv(x.numel(), c.kwargs["BLOCK"]),), warmup=False, **c.all_kwargs()
            )
        )[0]
        for c in configs
    )
    assert slow > 2 * fast


@pytest.mark.gpu
@pytest.mark.own_autotuning
def test_an_autotuner_whose_choice_is_on_disk_compiles_only_that_configuration(tmp_path, monkeypatch):
    import triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # empty: the first tuning leaves its choice here
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    compiled = _count_compiles()
    try:
        for run in ("first", "second"):  # the second as a new process meets it: same source, nothing in memory
            configs, launch_double, _ = _autotuned_kernels(cache_results=True)
            y = torch.empty_like(x)
            compiled.clear()
            with parallel_autotune(4):
                launch_double(x, y)
            torch.testing.assert_close(y, x * 2)
            assert len(compiled) == (configs if run == "first" else 1), run
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None


@pytest.mark.gpu
@pytest.mark.own_autotuning
def test_a_dry_forward_compiles_every_kernel_at_once_and_launches_none():
    import triton

    configs, _, forward = _autotuned_kernels()
    x = torch.randn(3000, device="cuda")
    y, z = torch.full_like(x, -7.0), torch.full_like(x, -7.0)
    compiled = _count_compiles()
    try:
        with compile_all_kernels_at_once(4):
            forward(x, y, z)
        torch.cuda.synchronize()
        assert len(compiled) == 2 * configs  # every configuration of both kernels...
        assert torch.all(y == -7) and torch.all(z == -7)  # ...and nothing launched
        with parallel_autotune(4):
            forward(x, y, z)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    torch.testing.assert_close(z, x * 2 + 1)
    assert len(compiled) == 2 * configs  # the timed forward compiled nothing again


@pytest.mark.gpu
@pytest.mark.own_autotuning
def test_the_dry_forward_builds_the_kernels_launcher_too(tmp_path, monkeypatch):
    import triton.runtime.build as build

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # empty: no launcher built yet
    _, _, forward = _autotuned_kernels()
    x = torch.randn(3000, device="cuda")
    y, z = torch.empty_like(x), torch.empty_like(x)
    with compile_all_kernels_at_once(4):
        forward(x, y, z)
    built, real_build = [], build._build
    monkeypatch.setattr(build, "_build", lambda name, *args: built.append(name) or real_build(name, *args))
    with parallel_autotune(4):
        forward(x, y, z)
    torch.testing.assert_close(z, x * 2 + 1)
    assert built == []  # the first launches found their launcher on disk
