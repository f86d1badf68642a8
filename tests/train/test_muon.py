"""train/muon.py: torch's Muon step for step, with the Newton-Schulz iteration in the step's dtype and
shared out over the ranks."""

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_cache.target import precision
from dflash_cache.train import muon
from dflash_cache.train.distributed import init_rank, launch, shutdown
from dflash_cache.train.muon import Muon, owners
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


def test_each_matrix_has_one_owner_the_costliest_first_to_the_least_loaded_rank():
    # one round costs 2a^2 b + a^3 (a <= b): (8, 8) 1536, (4, 4) 192, (2, 8) 72, (1, 1) 3
    shapes = [torch.Size(s) for s in [(4, 4), (2, 8), (8, 8), (1, 1)]]
    assert owners(shapes, 1) == [0, 0, 0, 0]
    assert owners(shapes, 2) == [1, 1, 0, 1]  # 1536 on rank 0; 192 + 72 + 3 on rank 1
    assert owners(shapes, 4) == [1, 2, 0, 3]
    assert owners([torch.Size((3, 5))] * 4, 3) == [0, 1, 2, 0]


def sharded_steps(rank: int, world: int, device: str, folder: str) -> None:
    init_rank(rank, world, device, timeout_s=60)
    calls = []
    real = muon.orthogonalise
    muon.orthogonalise = lambda update, group, dtype: calls.append(tuple(update.shape)) or real(update, group, dtype)
    params = run(lambda params: Muon(params, lr=1e-2, weight_decay=0.1, momentum=0.95, ns_dtype=torch.float32))
    save_file({str(i): p for i, p in enumerate(params)} | {"calls": torch.tensor(len(calls))}, f"{folder}/{rank}")
    shutdown()


@pytest.mark.slow
def test_two_ranks_each_orthogonalise_their_share_and_step_as_one_process(tmp_path):
    launch(sharded_steps, ["cpu", "cpu"], (str(tmp_path),))
    alone = run(lambda params: Muon(params, lr=1e-2, weight_decay=0.1, momentum=0.95, ns_dtype=torch.float32))
    ranks = [load_file(tmp_path / str(rank)) for rank in range(2)]
    # SHAPES' costs: (12, 12) 5184 to rank 0; (8, 6) 792 and (5, 8) 525 to rank 1; three steps
    assert [int(r["calls"]) for r in ranks] == [3, 6]
    for r in ranks:
        for i, p in enumerate(alone):
            assert torch.equal(r[str(i)], p)
