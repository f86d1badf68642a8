import warnings

import torch

from dflash_cache.train.optim import build_optimizer, build_scheduler


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
