import warnings

import pytest
import torch

from dflash_cache.train.optim import build_optimizer, build_scheduler, clipped_step, gradient_norm


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


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # clipping, and a norm below the limit
def test_clipped_step_equals_clip_grad_norm_then_the_step(fused, max_norm):
    """Against torch's own clip_grad_norm_ then step, over three steps: the fused AdamW divides by
    the clipping factor inside its kernel (fused=True runs on the CPU too), the others clip first."""
    torch.manual_seed(0)
    ours, reference = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    reference.load_state_dict(ours.state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.01, fused=fused) for m in (ours, reference)]
    norms = []
    for step in range(3):
        x = torch.randn(16, 8)
        for model in (ours, reference):
            model.zero_grad()
            (model(x) ** 2).sum().backward()
        total = gradient_norm(ours.parameters())
        norms.append(float(total))
        clipped_step(optimizers[0], total, max_norm)
        torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm), total)
        optimizers[1].step()
        for a, b in zip(ours.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not hasattr(optimizers[0], "grad_scale")
    assert (min(norms) > max_norm) if max_norm < 1 else (max(norms) < max_norm)  # each case is what it says
