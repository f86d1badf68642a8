import copy
import warnings

import pytest
import torch
from safetensors.torch import load_file

from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.checkpoint import WEIGHTS_FILE
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.target import precision
from dflash_cache.train.checkpoint import load_checkpoint, rng_state, save_checkpoint
from dflash_cache.train.optim import (
    CompiledAdamW,
    build_optimizer,
    build_scheduler,
    clipped_step,
    gradient_norm,
    lr_factor,
)
from tests.support.drafter import random_batch, random_head, tiny_drafter_config


def test_schedule_follows_the_step_count_even_when_a_step_is_skipped():
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, lr=1.0, weight_decay=0.0)
    schedule = build_scheduler(optimizer, warmup_steps=2, total_steps=4, min_lr_ratio=0.0)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's schedulers warn when stepped without an optimizer step
        for step in range(5):
            seen.append(schedule.get_last_lr()[0])
            if step != 0:  # step 0 skipped, as for a non-finite loss
                optimizer.step()
            schedule.step()
    # Warmup (s+1)/2, then cosine over the two remaining steps down to 0: 0.5, 1, 1, 0.5, 0.
    assert seen == [0.5, 1.0, 1.0, 0.5, 0.0]
    assert {g["lr"] for g in optimizer.param_groups} == {0.0}


def test_schedule_resumes_from_its_own_state_and_from_a_lambdalr_one():
    optimizer = build_optimizer(torch.nn.Linear(2, 2), lr=2.0, weight_decay=0.0)
    schedule = build_scheduler(optimizer, 2, 4, 0.0)
    schedule.load_state_dict({"steps": 3})
    assert schedule.get_last_lr() == [1.0, 1.0]
    schedule.load_state_dict({"last_epoch": 1, "_step_count": 2, "base_lrs": [2.0, 2.0]})
    assert schedule.get_last_lr() == [2.0, 2.0]


@pytest.mark.parametrize("ours", ["CompiledAdamW", "torch"])
@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # clipping, and a norm below the limit
def test_clipped_step_equals_clip_grad_norm_then_the_step(ours, max_norm):
    """Against torch's own clip_grad_norm_ then its plain AdamW step, over four steps with a learning
    rate that changes and weight decay on one group only: CompiledAdamW's update (run uncompiled on
    the CPU; the GPU test compiles it) divides by the clipping factor as it reads each gradient, torch's
    AdamW clips first."""
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    reference.load_state_dict(model.state_dict())

    def groups(m):
        return [{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "weight_decay": 0.0}]

    optimizer = (
        CompiledAdamW(groups(model), lr=0.1, betas=(0.9, 0.95), compile=False)
        if ours == "CompiledAdamW"
        else torch.optim.AdamW(groups(model), lr=0.1, betas=(0.9, 0.95))
    )
    expected = torch.optim.AdamW(groups(reference), lr=0.1, betas=(0.9, 0.95), foreach=False)
    norms = []
    for step in range(4):
        for opt in (optimizer, expected):
            for group in opt.param_groups:
                group["lr"] = 0.1 / (step + 1)
        x = torch.randn(16, 8)
        for m in (model, reference):
            m.zero_grad()
            (m(x) ** 2).sum().backward()
        total = gradient_norm(model.parameters())
        norms.append(float(total))
        clipped_step(optimizer, total, max_norm)
        torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm), total)
        expected.step()
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b)
    assert (min(norms) > max_norm) if max_norm < 1 else (max(norms) < max_norm)  # each case is what it says


def test_compiled_adamw_resumes_from_a_state_dict():
    """Its state dict is torch's AdamW's: saved and loaded, the next step is the one an uninterrupted
    optimizer makes."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    first = CompiledAdamW(models[0].parameters(), lr=0.1, compile=False)
    x = torch.randn(8, 4)

    def step(model, optimizer):
        model.zero_grad()
        (model(x) ** 2).sum().backward()
        optimizer.step()

    for _ in range(2):
        step(models[0], first)
    models[1].load_state_dict(models[0].state_dict())
    resumed = CompiledAdamW(models[1].parameters(), lr=0.1, compile=False)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))  # as from a file: no tensor shared
    step(models[0], first)
    step(models[1], resumed)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    assert resumed.state[models[1].weight]["step"].item() == 3


def test_bf16_matrices_are_copies_of_fp32_masters_that_follow_torch_adamw():
    """bf16_matrices: the weight matrix becomes bf16 and its master, updated in fp32 from bf16 gradients,
    follows torch's AdamW on an fp32 copy given the same gradients; the bias stays fp32 with no master."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    reference = [model.weight.detach().clone(), model.bias.detach().clone()]
    ours = CompiledAdamW(
        [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0}],
        lr=0.1,
        betas=(0.9, 0.95),
        compile=False,
        bf16_matrices=True,
    )
    expected = torch.optim.AdamW(
        [{"params": [reference[0]], "weight_decay": 0.1}, {"params": [reference[1]], "weight_decay": 0.0}],
        lr=0.1,
        betas=(0.9, 0.95),
        foreach=False,
    )
    assert model.weight.dtype == torch.bfloat16 and model.bias.dtype == torch.float32
    for _ in range(3):
        model.weight.grad = torch.randn(4, 8).bfloat16()
        model.bias.grad = torch.randn(4)
        reference[0].grad, reference[1].grad = model.weight.grad.float(), model.bias.grad.clone()
        clipped_step(ours, gradient_norm(model.parameters()), 1.0)
        torch.nn.utils.clip_grad_norm_(reference, 1.0)
        expected.step()
        master = ours.masters[model.weight]
        torch.testing.assert_close(master, reference[0])
        assert torch.equal(model.weight, master.bfloat16())
        torch.testing.assert_close(model.bias, reference[1])
    assert ours.state[model.weight]["exp_avg"].dtype == torch.float32
    assert set(ours.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # no master in it


def test_bf16_matrices_in_one_group_with_vectors():
    """A single group of a matrix and a vector (benchmarks/optimizer.py passes all parameters so): the same
    update as two groups."""
    torch.manual_seed(0)
    one, two = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    two.load_state_dict(one.state_dict())
    mixed = CompiledAdamW(one.parameters(), lr=0.1, weight_decay=0.0, compile=False, bf16_matrices=True)
    apart = CompiledAdamW(
        [{"params": [two.weight]}, {"params": [two.bias]}], lr=0.1, weight_decay=0.0, compile=False, bf16_matrices=True
    )
    for _ in range(2):
        for m in (one, two):
            m.weight.grad = torch.ones(4, 8, dtype=torch.bfloat16)
            m.bias.grad = torch.ones(4)
        mixed.step()
        apart.step()
    assert torch.equal(mixed.masters[one.weight], apart.masters[two.weight]) and torch.equal(one.bias, two.bias)


def test_gradient_norm_of_bf16_gradients_is_not_rounded_to_bf16():
    grads = [torch.tensor([1.0, 1.0 / 256]).bfloat16(), torch.tensor([3.0])]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    expected = (1 + 1 / 256**2 + 9) ** 0.5  # 3.16229..., which bf16 would round to 3.15625
    assert gradient_norm(params).dtype == torch.float32
    assert abs(gradient_norm(params).item() - expected) < 1e-6


def random_step(model, optimizer, scheduler, seed: int) -> None:
    """A clipped optimizer step on random gradients (in each parameter's dtype), then the schedule's."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    clipped_step(optimizer, gradient_norm(model.parameters()), 1.0)
    scheduler.step()


def test_a_checkpoint_of_bf16_working_weights_holds_the_masters_and_resumes_exactly(tmp_path):
    """A drafter whose matrices are bf16 copies: its checkpoint stores the fp32 masters as the drafter's
    weights, and a run resumed from it makes the uninterrupted run's next step exactly (masters, moments
    and bf16 weights)."""

    def drafter_and_optimizer():
        torch.manual_seed(0)
        model = DFlashDrafter(tiny_drafter_config(), random_head(0), tile=16)
        groups = [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = CompiledAdamW(groups, lr=1e-2, betas=(0.9, 0.95), compile=False, bf16_matrices=True)
        return model, optimizer, build_scheduler(optimizer, 1, 10, 0.1)

    first = drafter_and_optimizer()
    for seed in range(2):
        random_step(*first, seed)
    folder = save_checkpoint(tmp_path, 2, first[0], first[1], first[2], {"step": 2}, [rng_state()])
    saved = load_file(folder / WEIGHTS_FILE)
    for name, p in first[0].named_parameters():
        assert saved[name].dtype == torch.float32
        assert torch.equal(saved[name], first[1].masters.get(p, p)), name
    assert any(t.dtype == torch.bfloat16 for t in first[0].state_dict().values())  # the model holds copies

    resumed = drafter_and_optimizer()
    load_checkpoint(folder, *resumed)
    for models in (first, resumed):
        random_step(*models, 2)
    for (name, a), b in zip(first[0].named_parameters(), resumed[0].parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
        if a in first[1].masters:
            assert torch.equal(first[1].masters[a], resumed[1].masters[b]), name
            for key in ("exp_avg", "exp_avg_sq"):
                assert resumed[1].state[b][key].dtype == torch.float32
                assert torch.equal(first[1].state[a][key], resumed[1].state[b][key]), (name, key)


@pytest.mark.parametrize("lr", [3e-3, 1e-4])
def test_training_on_bf16_matrices_follows_fp32_weights_under_autocast(lr):
    """Six steps of the tiny drafter under bf16 autocast: with CompiledAdamW's bf16 working matrices the
    losses are those of fp32 weights and torch's AdamW (the forward casts the matrices to the same bf16
    values, the backward gives the same gradients, the masters take the same update) to the rounding of
    fp32 sums (below). bf16 weights updated in place with no masters drift 2.5e-4 to 4.3e-4 away on the same run."""

    def losses(bf16_matrices: bool) -> list[float]:
        torch.manual_seed(0)
        model = DFlashDrafter(tiny_drafter_config(), random_head(0), tile=16, attention="dense")
        groups = [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = (
            CompiledAdamW(groups, lr=lr, betas=(0.9, 0.95), compile=False, bf16_matrices=True)
            if bf16_matrices
            else torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
        )
        seen = []
        for seed in range(6):
            batch = random_batch([40, 23, 31], seed=seed)
            anchors = sample_anchors(batch, 4, 6, torch.Generator().manual_seed(seed))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(DraftInputs.build(batch, anchors))
            optimizer.zero_grad()
            out.loss.backward()
            clipped_step(optimizer, gradient_norm(model.parameters()), 1.0)
            seen.append(out.loss.item())
        return seen

    # Both runs multiply the same bf16 values, but a CPU's bf16 matmul kernels differ in how they add the
    # fp32 products (native bf16 dot products pair two products per add and flush subnormals; others
    # widen to fp32 FMAs), and the two runs need not get the same kernel. A dot product of length K then
    # differs by at most K * 2**-24 relative (fp32's unit roundoff per add), and the loss comes out of
    # 20 matmuls in sequence (fc; per layer q/k/v, QK^T, PV, o, gate/up, down; the head) with K <= 64
    # (fc's 2 x 32 inputs, the 64-wide MLP, a 40-token context plus a block of keys): 20 * 64 * 2**-24 = 7.6e-5, to first order.
    # Gradient differences move the weights by about lr times as little (Adam's update is normalised).
    # It stays under the 2.5e-4 drift of bf16 weights with no masters, which the test must still catch.
    assert losses(True) == pytest.approx(losses(False), rel=20 * 64 * 2**-24)


def test_muon_adamw_steps_as_torchs_muon_on_the_matrices_and_adamw_on_the_vectors(monkeypatch):
    """Each part makes the step its torch optimizer makes alone, at the schedule's rate: Muon with the
    RMS-matched rate and the weight decay on every 2-D weight, AdamW undecayed on the biases and norms.
    (Where bf16 is slow, Muon orthogonalises in fp32 instead: tests/train/test_muon.py.)"""
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 5))
    reference = copy.deepcopy(model)
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1, kind="muon")
    schedule = build_scheduler(optimizer, warmup_steps=1, total_steps=4, min_lr_ratio=0.0)
    matrices = [p for p in reference.parameters() if p.dim() == 2]
    vectors = [p for p in reference.parameters() if p.dim() == 1]
    muon = torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(vectors, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        for p, q, grad in zip(model.parameters(), reference.parameters(), grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        for part in (muon, adamw):
            part.param_groups[0]["lr"] = 1e-2 * lr_factor(step, 1, 4, 0.0)
            part.step()
        optimizer.step()
        schedule.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert sum(1 for p in model.parameters() if p.dim() == 2) == 2


def test_muon_adamw_resumes_from_a_checkpoint_exactly(tmp_path):
    """Both parts' state goes through a checkpoint (torch's layout, parameters numbered across the parts):
    the resumed run's next step equals the uninterrupted run's."""

    def drafter_and_optimizer():
        torch.manual_seed(0)
        model = DFlashDrafter(tiny_drafter_config(), random_head(0), tile=16)
        optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1, kind="muon")
        return model, optimizer, build_scheduler(optimizer, 1, 10, 0.1)

    first = drafter_and_optimizer()
    for seed in range(2):
        random_step(*first, seed)
    folder = save_checkpoint(tmp_path, 2, first[0], first[1], first[2], {"step": 2}, [rng_state()])
    resumed = drafter_and_optimizer()
    load_checkpoint(folder, *resumed)
    assert resumed[2].get_last_lr() == first[2].get_last_lr()
    for models in (first, resumed):
        random_step(*models, 2)
    for (name, a), b in zip(first[0].named_parameters(), resumed[0].parameters()):
        assert torch.equal(a, b), name
