"""The target's forward dtype: bf16, except on a CPU that computes bf16 products slowly, where the forward
runs in fp32 (the plan line says so); the cache stores bf16 states either way. A drafter's step likewise."""

import json

import pytest
import torch

from dflash_cache import open_cache
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.extract import worker
from dflash_cache.extract.events import ExtractEvents
from dflash_cache.extract.pipeline import ExtractOptions, extract
from dflash_cache.target import precision
from dflash_cache.train.train import train
from tests.support.tiny import build_target
from tests.support.train import make_cache, tiny_train_config

LENGTHS = [40, 23, 57]


@pytest.mark.parametrize(("bf16_seconds", "expected"), [(0.5, torch.float32), (0.0015, torch.bfloat16)])
def test_the_cpu_forward_is_fp32_where_bf16_products_are_slow(monkeypatch, bf16_seconds, expected):
    precision.cpu_bf16_is_fast.cache_clear()
    monkeypatch.setattr(precision, "product_seconds", lambda dtype: 0.001 if dtype == torch.float32 else bf16_seconds)
    assert precision.forward_dtype("cpu") == expected
    assert precision.forward_dtype("cuda:0") == torch.bfloat16  # never measured on a GPU
    precision.cpu_bf16_is_fast.cache_clear()


@pytest.mark.parametrize("fast", [False, True])
def test_extraction_runs_its_target_in_the_forward_dtype_and_says_so(monkeypatch, tmp_path, fast):
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: fast)
    loaded = []

    def load_target(*args, **kwargs):
        target = real_load_target(*args, **kwargs)
        loaded.append(next(target.model.parameters()).dtype)
        return target

    real_load_target = worker.load_target
    monkeypatch.setattr(worker, "load_target", load_target)
    target = build_target(tmp_path / "target", "llama", num_layers=3)
    g = torch.Generator().manual_seed(1)
    with open(tmp_path / "data.jsonl", "w") as f:
        for n in LENGTHS:
            f.write(json.dumps({"input_ids": torch.randint(4, 300, (n,), generator=g).tolist()}) + "\n")
    plans = []

    class Plans(ExtractEvents):
        def plan(self, samples: int, tokens: int, layout: str) -> None:
            plans.append(layout)

    extract(ExtractOptions(target=target, data=[tmp_path / "data.jsonl"], out=tmp_path / "cache"), Plans())
    assert loaded == [torch.bfloat16 if fast else torch.float32]
    assert ("in float32" in plans[0]) == (not fast), plans[0]
    cache = open_cache(tmp_path / "cache")
    assert cache.spec["hidden_dtype"] == "bfloat16" and cache[0].hidden.dtype == torch.bfloat16


@pytest.mark.parametrize("fast", [False, True])
def test_training_steps_in_fp32_where_bf16_products_are_slow(monkeypatch, tmp_path, fast):
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: fast)
    seen = []
    real_call = DrafterRunner.__call__

    def call(self, *args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), self.drafter.head.lm_head.dtype))
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(DrafterRunner, "__call__", call)
    train(tiny_train_config(tmp_path, make_cache(tmp_path / "cache"), steps=2), echo=lambda *a, **k: None)
    assert seen and set(seen) == {(True, torch.bfloat16) if fast else (False, torch.float32)}
