import copy
import warnings

import pytest
import torch

from dflash_cache.train.optim import CompiledAdamW, build_optimizer, build_scheduler, clipped_step, gradient_norm


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

    optimizer = (CompiledAdamW(groups(model), lr=0.1, betas=(0.9, 0.95), compile=False) if ours == "CompiledAdamW"
                 else torch.optim.AdamW(groups(model), lr=0.1, betas=(0.9, 0.95)))
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
