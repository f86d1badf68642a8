"""A mixture-of-experts target of the Qwen3.6-35B-A3B shape extracted as users run it: split over a group
of GPUs (`torchrun --nproc-per-node G -m dflash_cache_cli.main extract --tp G`), or a cut on one GPU.

A group (one host of G 80 GB GPUs; the full-depth target is about 70 GB of bf16 weights):

    python -m benchmarks.tensor_parallel --work /data/tp --tp 2 [--layers-cut N] [--reference-cut 20]
        [--tokens 500000] [--json tp.json]

One GPU (the cut extracted cold, ratio against its bare forward in the same call):

    python -m benchmarks.tensor_parallel --work /tmp/moe-cut --tp 1 --layers-cut 16 [--tokens 400000] [--json cut.json]

CPU smoke test (a tiny qwen3_5_moe, gloo between the processes):

    python -m benchmarks.tensor_parallel --work /tmp/tp-smoke --shape tiny --layers-cut 8 --device cpu --tp 2 \\
        --tokens 3000 --reference-cut 6

1. A random-weight qwen3_5_moe target (hidden 2048, 256 experts of 512 with 8 routed and a shared one of 512,
   full attention every fourth layer, vocabulary 248,320; 40 layers or --layers-cut) saved as a model
   directory with a tokenizer covering its vocabulary; with --tp > 1 also a cut of its first --reference-cut
   layers (the same weights), which fits one GPU; a group's target is built in host memory (about 70 GB at full
   depth). Pre-tokenized random records as extract_cold.py writes them.
2. `extract` at its defaults, cold (TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR empty), in a new process:
   under torchrun with `--tp G` for a group, plain `extract --gpus 0` for one GPU.
3. The bare forward of the same target on the same packed batches (HF's modules with logits, nothing kept):
   for a group, this script under torchrun loading the target split as extraction loads it.
4. A group only: the reference cut extracted on one GPU with `--layers` set to the group cache's layers
   that the cut holds; per such layer, the largest absolute difference between the two caches over
   every token, over that layer's largest absolute value.

Reported: extraction's tokens/s (its rank line: tokens over compute seconds) and end to end, its compile
seconds, the bare forward's tokens/s and the ratios, each process's peak GPU memory during extraction
(nvidia-smi, sampled every second), and the per-layer differences.

The one-GPU cut ran on an H100 at 16 layers (BENCHMARKS.md, "Extraction"); the group run has run only on the
CPU (`--shape tiny --device cpu`, two gloo processes). With transformers 5.25.0 the plan of
`--tp` splits attention, the linear-attention projections and the shared expert but keeps every routed
expert whole in each process (they are most of this shape's weights), so at full depth each 80 GB GPU
would hold about 65 GB of experts; the memory column says what a run needed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

from benchmarks.extract_cold import packed_batches, run_cli, timed_forward, write_data
from benchmarks.targets import word_tokenizer
from dflash_cache import open_cache
from dflash_cache.target.parallel import Group, join_launch, load_split
from dflash_cache.target.target import load_target
from dflash_cache.target.varlen import ATTENTION
from dflash_cache.train.distributed import free_port

LAYERS = 40


def moe_config(shape: str, layers: int) -> Qwen3_5MoeTextConfig:
    full_every_fourth = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4) + ["linear_attention"] * (
        layers % 4
    )
    if shape == "tiny":  # a smoke test on the CPU
        sizes = dict(vocab_size=1000, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        sizes |= dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16)
        sizes |= dict(linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        sizes |= dict(num_experts=4, num_experts_per_tok=2)
    else:
        sizes = dict(vocab_size=248320, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256)
        sizes |= dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128)
        sizes |= dict(linear_value_head_dim=128, moe_intermediate_size=512, shared_expert_intermediate_size=512)
        sizes |= dict(num_experts=256, num_experts_per_tok=8)
    return Qwen3_5MoeTextConfig(
        **sizes, num_hidden_layers=layers, layer_types=full_every_fourth, tie_word_embeddings=False
    )


def save_targets(folder: Path, config, device: str, cut: int | None) -> tuple[int, Path | None]:
    """The target (random bf16 weights, seed 0) and, given `cut`, a target of its first `cut` layers
    with the same weights. Returns the parameter count and the cut's folder."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    tokenizer = word_tokenizer(config.vocab_size)
    model.save_pretrained(folder / "target", max_shard_size="4GB")
    tokenizer.save_pretrained(folder / "target")
    cut_dir = None
    if cut is not None:
        cut_dir = folder / f"target-cut{cut}"
        model.model.layers = model.model.layers[:cut]
        model.config = copy.deepcopy(config)
        model.config.num_hidden_layers, model.config.layer_types = cut, config.layer_types[:cut]
        model.save_pretrained(cut_dir, max_shard_size="4GB")
        tokenizer.save_pretrained(cut_dir)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return params, cut_dir


def read_rows(data: Path) -> list[np.ndarray]:
    return [np.asarray(r, dtype=np.int64) for r in pq.read_table(data)["input_ids"].to_pylist()]


class MemoryPeaks:
    """Each GPU's peak used memory (MiB) while running, from nvidia-smi every second."""

    def __init__(self, on: bool):
        self.on, self.peaks, self.stop = on, {}, threading.Event()

    def __enter__(self) -> MemoryPeaks:
        if self.on:
            self.thread = threading.Thread(target=self._poll, daemon=True)
            self.thread.start()
        return self

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        while not self.stop.wait(1.0):
            for line in subprocess.run(query, capture_output=True, text=True).stdout.splitlines():
                gpu, used = (int(x) for x in line.split(","))
                self.peaks[gpu] = max(self.peaks.get(gpu, 0), used)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.on:
            self.thread.join()


def torchrun(nproc: int) -> tuple[str, ...]:
    return (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)) + (
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    )


def bare_worker(target: Path, data: Path, out: Path) -> None:
    """One process of the group's bare forward (under torchrun): the target split as extraction splits it."""
    rank, local, tp = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        torch.cuda.set_device(device)
    join_launch(device)
    model = load_split(target, torch.bfloat16, ATTENTION, Group(rank, tp)).eval()
    rows = read_rows(data)
    rate = timed_forward(model, packed_batches(rows, device), sum(map(len, rows)), device)
    if rank == 0:
        out.write_text(json.dumps({"tok_s": rate}))


def layer_differences(group: Path, reference: Path) -> dict[int, float]:
    """Per layer both caches hold: max |a - b| over every token, over max |a| (a: the group's)."""
    a_cache, b_cache = open_cache(group), open_cache(reference)
    a_layers, b_layers = a_cache.spec["layer_ids"], b_cache.spec["layer_ids"]
    width = a_cache.spec["target"]["hidden_size"]
    diff = dict.fromkeys(b_layers, 0.0)
    peak = dict.fromkeys(b_layers, 0.0)
    for sid in sorted(a_cache):
        a, b = a_cache[sid], b_cache[sid]
        if a.input_ids.tolist() != b.input_ids.tolist():
            raise SystemExit(f"sample {sid} holds other tokens in the two caches")
        for j, layer in enumerate(b_layers):
            i = a_layers.index(layer)
            x = a.hidden[:, i * width : (i + 1) * width].float()
            y = b.hidden[:, j * width : (j + 1) * width].float()
            diff[layer] = max(diff[layer], float((x - y).abs().max()))
            peak[layer] = max(peak[layer], float(x.abs().max()))
    return {layer: diff[layer] / peak[layer] for layer in b_layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/tensor-parallel"))
    parser.add_argument("--shape", choices=["qwen3.6-35b-a3b", "tiny"], default="qwen3.6-35b-a3b")
    parser.add_argument("--layers-cut", type=int, default=None, help=f"the target's layers (default: all {LAYERS})")
    parser.add_argument("--tp", type=int, default=2, help="GPUs (processes) the target is split over; 1: one GPU")
    parser.add_argument("--reference-cut", type=int, default=20, help="--tp > 1: layers of the one-GPU reference")
    parser.add_argument("--tokens", type=int, default=500_000)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = args.work
    if args.bare_worker:
        bare_worker(work / "target", work / "data.parquet", work / "bare.json")
        return

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config = moe_config(args.shape, args.layers_cut or LAYERS)
    group = args.tp > 1
    # A group's target is built on the CPU: whole, it does not fit one GPU.
    build = "cpu" if group or args.device == "cpu" else "cuda"
    params, cut_dir = save_targets(work, config, build, args.reference_cut if group else None)
    rows = write_data(work / "data.parquet", args.tokens, config.vocab_size)
    tokens = sum(map(len, rows))
    print(f"target {config.num_hidden_layers} layers, {params / 1e9:.2f}B parameters; {tokens} tokens", flush=True)

    on_gpu = args.device == "cuda"
    launcher = torchrun(args.tp) if group else ()
    extra = ("--tp", str(args.tp)) if group else ("--gpus", "0") if on_gpu else ()
    with MemoryPeaks(on_gpu) as memory:
        extraction = run_cli(
            work / "target",
            work / "data.parquet",
            work / "cache",
            work / "kernels",
            work / "extract.log",
            launcher,
            extra,
        )
    # The bare forward loads the kernels and autotuning results extraction left, instead of tuning again.
    os.environ["TRITON_CACHE_DIR"] = str(work / "kernels" / "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "kernels" / "inductor")
    if group:
        command = [*torchrun(args.tp), "-m", "benchmarks.tensor_parallel", "--bare-worker", "--work", str(work)]
        subprocess.run(command, check=True)
        bare = json.loads((work / "bare.json").read_text())["tok_s"]
    else:
        target = load_target(work / "target", f"{args.device}:0" if on_gpu else "cpu", attention=ATTENTION)
        device = str(target.model.device)
        bare = timed_forward(target.model, packed_batches(rows, device), tokens, device)
        del target
    result = {
        "shape": args.shape,
        "layers": config.num_hidden_layers,
        "params": params,
        "tp": args.tp,
        "tokens": tokens,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "extract": extraction,
        "extract_peak_mib": memory.peaks,
        "bare_tok_s": bare,
        "ratio": extraction["tok_s"] / bare,
        "end_to_end_ratio": extraction["end_to_end_tok_s"] / bare,
    }
    if group:
        layers = open_cache(work / "cache").spec["layer_ids"]
        held = ",".join(str(layer) for layer in layers if layer < args.reference_cut)
        if not held:
            raise SystemExit(f"--reference-cut {args.reference_cut} holds none of the cache's layers {layers}")
        reference = run_cli(
            cut_dir,
            work / "data.parquet",
            work / "reference",
            work / "kernels",
            work / "reference.log",
            extra=("--layers", held, *(("--gpus", "0") if on_gpu else ())),
        )
        result["reference"] = {"layers": args.reference_cut, "tok_s": reference["tok_s"]}
        result["max_abs_diff_over_layer_max"] = layer_differences(work / "cache", work / "reference")
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
