"""`dflash-cache extract` as a user runs it, cold and then with a warm kernel cache, against the
warm bare forward of the same target on the same tokens, all in one call.

    PYTHONPATH=. python benchmarks/extract_cold.py [--layers-cut 16] [--tokens 1000000] [--work DIR] [--json FILE]

1. A random-weight hybrid qwen3_5 target of the Qwen3.6-27B shape cut to --layers-cut layers is
   saved as a model directory (safetensors) with a tokenizer covering its vocabulary.
2. Pre-tokenized data: lengths lognormal around 2,600 tokens (cut to 64..8192), random ids, as a
   parquet file of `input_ids`.
3. `dflash-cache extract --target T --data D --out C` with default options in a new process, with
   TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR pointing at an empty folder (cold); then the cache is
   deleted and the same command runs again with those folders kept (warm).
4. In this process: the target loaded as extraction loads it, one warm-up row, then the bare
   forward (the model's own forward with logits, nothing kept) of every row of the same packed plan,
   through HF's own modules ("bare", the reference of the ratios) and through target/fused.py's
   kernels ("bare fused", what extraction itself runs).

Reported: each run's wall time, its compile seconds (the warm-up forward), its tokens/s from the
first batch to the last shard committed, and those rates over the bare forward's; MFU of the bare
forward and of extraction against the bf16 matmul rate measured here (2 x parameters FLOPs per
token, the input embedding left out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from benchmarks.extract import matmul_tflops
from benchmarks.targets import target_config, word_tokenizer
from dflash_cache.data.dataset import Sample
from dflash_cache.extract.options import TOKEN_BUDGETS
from dflash_cache.extract.packing import PackedLayout
from dflash_cache.target.fused import fused_kernels
from dflash_cache.target.target import load_target
from dflash_cache.target.varlen import ATTENTION, packed_kernels

RANK_LINE = re.compile(
    r"rank 0: ([\d,]+) tokens, ([\d,]+) tokens/s, ([\d.]+) s (?:compiling|on a warm-up forward)"
)  # the CLI's summary line
AHEAD_LINE = re.compile(r"kernels compiled and autotuned ahead, .*: ([\d.]+) s")


def save_target(folder: Path, layers: int, device: str) -> int:
    """Returns the parameter count without the input embedding (a lookup: no FLOPs)."""
    config = target_config("qwen3.6-27b-cut", layers)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    model.save_pretrained(folder, max_shard_size="4GB")
    word_tokenizer(config.vocab_size).save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return params


def write_data(path: Path, tokens: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    rows, total = [], 0
    while total < tokens:
        n = int(np.clip(rng.lognormal(np.log(2600), 0.9), 64, 8192))
        rows.append(rng.integers(0, vocab, n, dtype=np.int64))
        total += n
    pq.write_table(pa.table({"input_ids": pa.array([r.tolist() for r in rows], type=pa.list_(pa.int32()))}), path)
    return rows


def run_cli(
    target: Path,
    data: Path,
    out: Path,
    kernels: Path,
    log: Path,
    launcher: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
) -> dict:
    """`extract` at its defaults (plus `extra`), in a new process started by `launcher` (default: this
    Python), with the kernel caches in `kernels`."""
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": str(kernels / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(kernels / "inductor"),
        "PYTHONUNBUFFERED": "1",
    }
    start = time.perf_counter()
    proc = subprocess.run(
        [
            *(launcher or (sys.executable,)),
            "-m",
            "dflash_cache_cli.main",
            "extract",
            "--target",
            str(target),
            "--data",
            str(data),
            "--out",
            str(out),
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    log.write_text(proc.stdout + "\n" + proc.stderr)
    print(proc.stdout[-1500:], proc.stderr[-1500:], sep="\n")
    if proc.returncode != 0:
        raise SystemExit(f"extract failed ({proc.returncode})")
    match = RANK_LINE.search(proc.stdout)
    if match is None:
        raise SystemExit(
            f"the CLI's rank line was not in its output ({log}): benchmarks/extract_cold.py RANK_LINE needs updating"
        )
    tokens, rate, compile_s = (
        int(match.group(1).replace(",", "")),
        float(match.group(2).replace(",", "")),
        float(match.group(3)),
    )
    ahead = AHEAD_LINE.search(proc.stderr)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": rate,
        "compile_s": compile_s,
        "end_to_end_tok_s": tokens / wall,
        "compile_ahead_s": float(ahead.group(1)) if ahead else None,
    }


def packed_batches(rows: list[np.ndarray], device: str) -> list:
    """The packed plan of `rows` at extraction's default token budget on `device`, as it builds it."""
    samples = [Sample(i, r.astype(np.int32), np.ones(len(r), dtype=bool)) for i, r in enumerate(rows)]
    layout = PackedLayout(max(TOKEN_BUDGETS[torch.device(device).type], max(len(r) for r in rows)))
    plan = layout.plan([s.sample_id for s in samples], [len(s.input_ids) for s in samples])
    return [layout.build([samples[i] for i in b], device) for b in plan]


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_forward(model, batches: list, tokens: int, device: str, fused: bool = False) -> float:
    """Warm tokens/s of the model's own forward (with logits, nothing kept) over `batches`."""
    with (
        torch.inference_mode(),
        packed_kernels(model),
        fused_kernels(model) if fused else nullcontext(),
    ):
        model(input_ids=batches[0].input_ids, use_cache=False, **batches[0].forward_kwargs())  # warm-up
        synchronize(device)
        start = time.perf_counter()
        for fb in batches:
            model(input_ids=fb.input_ids, use_cache=False, **fb.forward_kwargs())
        synchronize(device)
    return tokens / (time.perf_counter() - start)


def bare_forward(
    target_dir: Path, rows: list[np.ndarray], device: str, kinds: tuple[str, ...] = ("hf", "fused")
) -> tuple[dict[str, float], int]:
    """Warm tokens/s of the model's own forward over the packed plan of `rows` (HF's modules, and
    fused), and the rows' count."""
    target = load_target(target_dir, device, attention=ATTENTION)
    batches = packed_batches(rows, device)
    tokens = sum(len(r) for r in rows)
    rates = {name: timed_forward(target.model, batches, tokens, device, fused=name == "fused") for name in kinds}
    return rates, len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers-cut", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/extract-cold"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--logs", type=Path, default=None, help="folder for the two runs' full output (default: --work)"
    )
    args = parser.parse_args()
    device = "cuda"
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    target, data, cache, kernels = (
        args.work / "target",
        args.work / "data.parquet",
        args.work / "cache",
        args.work / "kernels",
    )
    started = time.perf_counter()
    params = save_target(target, args.layers_cut, device)
    rows = write_data(data, args.tokens, 248320)
    print(
        f"target {args.layers_cut} layers, {params / 1e9:.2f}B parameters; data {len(rows)} samples, "
        f"{sum(map(len, rows))} tokens ({time.perf_counter() - started:.0f} s to write both)",
        flush=True,
    )
    logs = args.logs or args.work
    logs.mkdir(parents=True, exist_ok=True)
    cold = run_cli(target, data, cache, kernels, logs / "extract_cold.log")
    shutil.rmtree(cache)
    warm = run_cli(target, data, cache, kernels, logs / "extract_warm.log")
    shutil.rmtree(cache)
    # The bare forward loads the kernels and autotuning results the runs left, instead of tuning again.
    os.environ["TRITON_CACHE_DIR"], os.environ["TORCHINDUCTOR_CACHE_DIR"] = (
        str(kernels / "triton"),
        str(kernels / "inductor"),
    )
    bares, num_rows = bare_forward(target, rows, device)
    bare = bares["hf"]
    peak = matmul_tflops(device)
    flops_per_token = 2 * params
    result = {
        "layers": args.layers_cut,
        "params": params,
        "samples": len(rows),
        "tokens": sum(map(len, rows)),
        "rows": num_rows,
        "cold": cold,
        "warm": warm,
        "bare_tok_s": bare,
        "cold_ratio": cold["tok_s"] / bare,
        "warm_ratio": warm["tok_s"] / bare,
        "bare_fused_tok_s": bares["fused"],
        "warm_ratio_to_fused": warm["tok_s"] / bares["fused"],
        "cold_end_to_end_ratio": cold["end_to_end_tok_s"] / bare,
        "warm_end_to_end_ratio": warm["end_to_end_tok_s"] / bare,
        "matmul_tflops": peak,
        "bare_mfu": bare * flops_per_token / 1e12 / peak,
        "bare_fused_mfu": bares["fused"] * flops_per_token / 1e12 / peak,
        "extract_mfu_warm": warm["tok_s"] * flops_per_token / 1e12 / peak,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
