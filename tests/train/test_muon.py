"""train/muon.py: torch's Muon step for step, with the Newton-Schulz iteration in the step's dtype."""

import copy

import pytest
import torch

from dflash_cache.target import precision
from dflash_cache.train.muon import Muon
from dflash_cache.train.optim import build_optimizer

SHAPES = [(8, 6), (5, 8), (12, 12)]  # tall, wide and square: the iteration runs on the wide side


def run(optimizer_for, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = optimizer_for(params)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return [p.detach().clone() for p in params]


def torch_muon(params):
    return torch.optim.Muon(params, lr=1e-2, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")


def test_in_bf16_it_is_torchs_muon_bit_for_bit():
    ours = run(lambda params: Muon(params, lr=1e-2, weight_decay=0.1, momentum=0.95, ns_dtype=torch.bfloat16))
    for a, b in zip(ours, run(torch_muon)):
        assert torch.equal(a, b)


def test_in_fp32_it_differs_from_torchs_only_by_bf16_rounding():
    ours = run(lambda params: Muon(params, lr=1e-2, weight_decay=0.1, momentum=0.95, ns_dtype=torch.float32))
    start = run(torch_muon, steps=0)
    for a, b, w in zip(ours, run(torch_muon), start):
        # each of torch's 5 iterations rounds its products to bf16 (8 significant bits): the two updates
        # part by at most about 5 x 2**-8 of the distance a weight moved; a wrong step parts by far more
        moved = (b - w).abs().max()
        assert not torch.equal(a, b)
        assert (a - b).abs().max() <= 5 * 2**-8 * moved


@pytest.mark.parametrize(("fast", "dtype"), [(True, torch.bfloat16), (False, torch.float32)])
def test_the_drafters_muon_iterates_in_the_steps_dtype(monkeypatch, fast, dtype):
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: fast)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8))
    optimizer = build_optimizer(copy.deepcopy(model), lr=1e-2, weight_decay=0.1, kind="muon")
    assert optimizer.parts[0].ns_dtype == dtype
