"""Extraction throughput against the bare forward of the same target on the same batches.

    PYTHONPATH=. python benchmarks/extract.py [--shape qwen3-8b|qwen3.6-27b-cut] [--layers-cut N] [--tokens 400000]
                                              [--batch-tokens 16384] [--codec bf16-zstd] [--out DIR]

A random-weight target is built on the GPU from a config (no weights on disk): Qwen3-8B shape
(36 layers, hidden 4096) or a Qwen3.6-27B-shaped hybrid qwen3_5 text model cut to fewer layers.
Samples have random token ids and log-uniform lengths from 256 to 4096. Both runs use the batches
the extraction plan makes at --batch-tokens, packed rows (default) or padded buckets (--batching padded):
  bare:    model(input_ids) with logits, nothing kept (what the target costs by itself): HF's own
           modules, and with --fused-bare also through target/fused.py's kernels
  plain:   with --plain, also HF's own padded forward (sdpa) on the pre-packing plan's first batches
  extract: the real per-rank extraction loop (hooks on 5 layers, chunked LM-head argmax, encode on
           the GPU, pinned copies, compression threads, shard writer with fsync) into --out
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks.profiling import profile_run
from benchmarks.targets import SHAPES, build_target, make_samples, target_config
from dflash_cache.data.dataset import Sample
from dflash_cache.data.plan import plan_batches
from dflash_cache.extract.buckets import BucketLayout
from dflash_cache.extract.packing import PackedLayout
from dflash_cache.extract.worker import RankJob, run_rank
from dflash_cache.store.codecs import CODECS, SUBSPACE_CODECS, compress, encode
from dflash_cache.target.fused import fused_kernels
from dflash_cache.target.runner import TargetRunner, padded_batch
from dflash_cache.target.target import resolve_layer_ids
from dflash_cache.target.varlen import packed_kernels
from dflash_cache.target.warmup import compile_threads, parallel_autotune


def codec_bytes_per_token(runner: TargetRunner, samples: list[Sample], device: str) -> dict[str, float]:
    """Stored bytes per token of each codec on one batch of this target's captured hidden states (the
    subspace codecs need a fitted basis: benchmarks/codec_sizes.py measures them)."""
    input_ids, lengths = padded_batch(samples, device)
    hidden = runner.run(input_ids, lengths).hidden
    sizes = dict.fromkeys((c for c in CODECS if c not in SUBSPACE_CODECS), 0)
    for b, n in enumerate(lengths.tolist()):
        for codec in sizes:
            encoded = encode(hidden[b, :n], codec, len(runner.layer_ids))
            sizes[codec] += compress(encoded.planes.cpu().numpy(), codec).nbytes
            sizes[codec] += 0 if encoded.scales is None else encoded.scales.numel() * 4
    return {codec: size / int(lengths.sum()) for codec, size in sizes.items()}


def matmul_tflops(device: str, m: int = 8192, k: int = 8192, n: int = 8192) -> float:
    """bf16 [m, k] x [k, n] matmul rate on random data (default 8192^3), the MFU ceiling measured in this run."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * m * k * n / (time.perf_counter() - start) / 1e12


def plain_forward(model, samples: list[Sample], args, sync) -> dict:
    """HF's own forward as it was called before packing: sdpa, right-padded batches of the old plan
    (its first `args.plain` batches, each shape warmed up first)."""
    by_id = {s.sample_id: s for s in samples}
    batches = plan_batches(
        [s.sample_id for s in samples], [len(s.input_ids) for s in samples], args.batch_tokens, seed=None
    )[: args.plain]
    model.set_attn_implementation("sdpa")
    inputs = [padded_batch([by_id[i] for i in b], args.device)[0] for b in batches]
    with torch.inference_mode():
        for ids in inputs:
            model(input_ids=ids, use_cache=False)
        sync()
        start = time.perf_counter()
        for ids in inputs:
            model(input_ids=ids, use_cache=False)
        sync()
    seconds = time.perf_counter() - start
    real = sum(len(by_id[i].input_ids) for b in batches for i in b)
    padded = sum(ids.numel() for ids in inputs)
    return {"batches": len(batches), "tok_s": real / seconds, "padding": padded / real}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    parser.add_argument("--layers-cut", type=int, default=None, help="layers of the cut 27B shape (a multiple of 4)")
    parser.add_argument("--tokens", type=int, default=400_000)
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--codec", default="bf16-zstd")
    parser.add_argument("--out", type=Path, default=None, help="cache directory (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batching", choices=["packed", "padded"], default="packed")
    parser.add_argument(
        "--plain",
        type=int,
        default=0,
        help="also time HF's padded forward on this many batches of the pre-packing plan",
    )
    parser.add_argument("--compress-threads", type=int, default=12)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="after the timed runs, profile 3 batches of the bare fused forward and of extraction: traces and tables here",
    )
    args = parser.parse_args()
    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    config = target_config(args.shape, args.layers_cut)
    work = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    layout = PackedLayout(args.batch_tokens) if args.batching == "packed" else BucketLayout(args.batch_tokens, 8192)
    target = build_target(config, device, work / "target", attention=layout.attention)
    model = target.model
    params = (
        sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    )  # a lookup: no FLOPs
    layer_ids = resolve_layer_ids(config.num_hidden_layers, None, 5)
    samples = make_samples(args.tokens, config.vocab_size)
    by_id = {s.sample_id: s for s in samples}
    batches = layout.plan([s.sample_id for s in samples], [len(s.input_ids) for s in samples])
    tokens = sum(len(s.input_ids) for s in samples)
    inputs = [layout.build([by_id[i] for i in b], device) for b in batches]
    positions = sum(fb.shape[0] * fb.shape[1] for fb in inputs)
    print(
        f"target: {args.shape} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, {params / 1e9:.2f}B parameters), random weights, bf16"
    )
    print(
        f"data: {len(samples)} samples, {tokens} tokens ({positions / tokens:.3f}x positions per token), {len(batches)} batches: "
        f"{layout.describe()}; layers {layer_ids}; codec {args.codec}"
    )

    def bare(fused: bool = False, run_inputs=inputs) -> tuple[float, float]:
        """Seconds for all batches, and seconds until the last one was queued (a queue that runs
        ahead of the GPU returns early; a forward that syncs inside does not)."""
        sync()
        start = time.perf_counter()
        with torch.inference_mode(), packed_kernels(model), fused_kernels(model) if fused else nullcontext():
            for fb in run_inputs:
                model(input_ids=fb.input_ids, use_cache=False, **fb.forward_kwargs())
        queued = time.perf_counter() - start
        sync()
        return time.perf_counter() - start, queued

    def extract(run_batches: list[list[int]]) -> tuple[float, dict]:
        out = args.out or work / "cache"
        shutil.rmtree(out, ignore_errors=True)
        spec = {
            "target": {
                "name": args.shape,
                "model_type": config.model_type,
                "config_hash": target.config_hash,
                "num_layers": config.num_hidden_layers,
                "hidden_size": config.hidden_size,
                "vocab_size": config.vocab_size,
            },
            "layer_ids": layer_ids,
            "codec": args.codec,
            "hidden_dtype": "bfloat16",
            "tokenizer_hash": "",
            "data_hash": "",
            "max_length": 8192,
            "topk": 0,
        }
        job = RankJob(
            root=out,
            target_path=target.path,
            device=device,
            rank=0,
            spec=spec,
            layout=layout,
            batches=run_batches,
            samples=by_id,
            done=set(),
            first_shard_index=0,
            compress_threads=args.compress_threads,
        )
        handed_off = []  # parts the main loop handed to the host side
        gpu_done = [0.0]  # when the device had finished everything, copies to the host included

        def report(progress) -> None:
            if threading.current_thread() is threading.main_thread():
                handed_off.append(progress)
                if len(handed_off) == len(run_batches):  # the last part: all device work is queued
                    sync()
                    gpu_done[0] = time.perf_counter()

        sync()
        start = time.perf_counter()
        summary = run_rank(job, report, target=target)
        wall = time.perf_counter() - start
        return wall, {
            "bytes": summary.bytes,
            "wait_s": summary.wait_s,
            "host_tail_s": start + wall - gpu_done[0],
            "window_s": summary.compute_s,
        }

    sync()
    start = time.perf_counter()
    with torch.inference_mode(), packed_kernels(model), fused_kernels(model), parallel_autotune(compile_threads()):
        model(input_ids=inputs[0].input_ids, use_cache=False, **inputs[0].forward_kwargs())
    sync()
    first_forward_s = time.perf_counter() - start  # cold when the kernel caches are empty: extraction's warm-up
    with torch.inference_mode(), packed_kernels(model):
        model(input_ids=inputs[0].input_ids, use_cache=False, **inputs[0].forward_kwargs())  # HF's own modules
    on_gpu = device.startswith("cuda")
    gemm_shape = (args.batch_tokens, config.hidden_size, config.intermediate_size)  # the MLP up-projection of a row
    peak_before = matmul_tflops(device) if on_gpu else float("nan")
    gemm_before = matmul_tflops(device, *gemm_shape) if on_gpu else float("nan")
    bare(run_inputs=inputs[:1])  # warm-up (packed rows have one shape): allocator
    bare(fused=True, run_inputs=inputs[:1])
    extract(batches[:2])  # warm-up: the LM-head chunks, pinned staging memory (kept by torch's host cache)
    t_bare, q_bare = bare()
    t_fused, _ = bare(fused=True)
    t_extract, info = extract(batches)  # after the bare runs: a GPU that slows as it heats counts against it
    per_codec = codec_bytes_per_token(
        TargetRunner(target, layer_ids), [by_id[i] for i in batches[len(batches) // 2]], device
    )
    if args.profile:
        profile_run(args.profile, "bare_fused", lambda: bare(fused=True, run_inputs=inputs[:3]))
        profile_run(args.profile, "extract", lambda: extract(batches[:3]))
    plain = plain_forward(model, samples, args, sync) if args.plain else None
    peak = matmul_tflops(device) if on_gpu else float("nan")
    gemm = matmul_tflops(device, *gemm_shape) if on_gpu else float("nan")
    mfu = lambda seconds: tokens / seconds * 2 * params / 1e12 / peak  # noqa: E731
    result = {
        "batching": layout.describe(),
        "params": params,
        "first_forward_s": first_forward_s,
        "matmul_tflops": peak,
        "matmul_tflops_before": peak_before,
        "gemm_shape": gemm_shape,
        "gemm_tflops_before": gemm_before,
        "gemm_tflops": gemm,
        "bare_mfu": mfu(t_bare),
        "bare_fused_mfu": mfu(t_fused),
        "extract_mfu": mfu(t_extract),
        "bare_fused_tok_s": tokens / t_fused,
        "ratio_to_fused": t_fused / t_extract,
        # `extract_tok_s` counts run_rank's whole call, its warm-up forward of one row included; the
        # window is the CLI's: from the first batch to the last shard committed.
        "extract_window_tok_s": tokens / info["window_s"],
        "window_ratio": t_bare / info["window_s"],
        "window_ratio_to_fused": t_fused / info["window_s"],
        "plain_padded": plain,
        "shape": args.shape,
        "layers": config.num_hidden_layers,
        "tokens": tokens,
        "batch_tokens": args.batch_tokens,
        "codec": args.codec,
        "bare_tok_s": tokens / t_bare,
        "extract_tok_s": tokens / t_extract,
        "ratio": t_bare / t_extract,
        "bare_queued_fraction": q_bare / t_bare,
        "compress_threads": args.compress_threads,
        "bytes_per_token": info["bytes"] / tokens,
        "wait_on_disk_s": info["wait_s"],
        "host_tail_s": info["host_tail_s"],
        "ratio_without_tail": t_bare / (t_extract - info["host_tail_s"]),
        "codec_bytes_per_token": per_codec,
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else 0.0,
    }
    print(
        f"first forward: {first_forward_s:.1f} s; matmul 8192^3 {peak_before:.0f} TFLOP/s before the runs, {peak:.0f} after; "
        f"{gemm_shape} {gemm_before:.0f} before, {gemm:.0f} after"
    )
    if plain:
        print(
            f"HF padded forward (sdpa, pre-packing plan, {plain['batches']} batches, warm): {plain['tok_s']:,.0f} tokens/s, "
            f"MFU {plain['tok_s'] * 2 * params / 1e12 / peak:.3f}"
        )
    print(f"bare forward:  {result['bare_tok_s']:,.0f} tokens/s  MFU {result['bare_mfu']:.3f} (HF's modules)")
    print(
        f"bare fused:    {result['bare_fused_tok_s']:,.0f} tokens/s  MFU {result['bare_fused_mfu']:.3f} (target/fused.py)"
    )
    print(
        f"extraction:    {result['extract_tok_s']:,.0f} tokens/s  ratio {result['ratio']:.3f}  "
        f"({result['bytes_per_token']:,.0f} bytes/token stored, {info['wait_s']:.1f} s waiting on disk, "
        f"{info['host_tail_s']:.1f} s from the GPU's last copy to the last shard committed; "
        f"ratio without that tail {result['ratio_without_tail']:.3f}) MFU {result['extract_mfu']:.3f}; "
        f"ratio to the bare fused forward {result['ratio_to_fused']:.3f} (the call, its warm-up forward included)"
    )
    print(
        f"  from the first batch to the last shard: {result['extract_window_tok_s']:,.0f} tokens/s, ratio {result['window_ratio']:.3f}, "
        f"to the bare fused forward {result['window_ratio_to_fused']:.3f}"
    )
    print("bytes/token by codec (one batch): " + ", ".join(f"{c} {v:,.0f}" for c, v in per_codec.items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
