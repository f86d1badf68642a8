"""The rank's warm-up forward (target/warmup.py) on the CPU: where it stops. Its compiling and
autotuning run on a GPU only (tests/test_fused.py)."""

import importlib.util

import pytest
import torch

from dflash_cache.extract.packing import PackedLayout
from dflash_cache.target.runner import TargetRunner
from dflash_cache.target.target import load_target
from dflash_cache.target.varlen import ATTENTION
from dflash_cache.target.warmup import reach_every_kernel
from tests.test_packing import LENGTHS, random_samples


def test_the_warm_up_forward_stops_after_the_first_layer_of_each_kind(target_dir):
    if "qwen3_5" in str(target_dir) and importlib.util.find_spec("fla") is not None:
        pytest.skip(
            "transformers sends the CPU reference's linear attention to flash-linear-attention, which runs on GPUs only"
        )
    target = load_target(target_dir, "cpu", torch.float32, attention=ATTENTION)
    ran = []
    for index, layer in enumerate(target.layers):
        layer.register_forward_pre_hook(lambda module, args, index=index: ran.append(index))
    reach_every_kernel(
        TargetRunner(target, [0, 2, 5]), PackedLayout(400).build(random_samples(LENGTHS, target.vocab_size), "cpu")
    )
    # tests/tiny.py: qwen3 layers are all full attention; qwen3_5's repeat linear, linear, full
    assert ran == ([0] if "qwen3_5" not in str(target_dir) else [0, 1, 2])
