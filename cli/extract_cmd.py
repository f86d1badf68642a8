import sys
from pathlib import Path

import click
from tqdm import tqdm

from dflash_cache.choices import CODECS
from dflash_cache.progress import ProgressLog
from dflash_cache_cli.options import INT_LIST


@click.command("extract")
@click.option("--target", required=True, type=click.Path(path_type=Path), help="Hugging Face model directory of the target (loaded in bf16).")
@click.option("--data", required=True, multiple=True, type=click.Path(path_type=Path),
              help="Conversations JSONL ({'messages': [...]} or ShareGPT {'conversations': [...]}), or pre-tokenized Parquet/Arrow/JSONL with input_ids (and loss_mask). Repeatable.")
@click.option("--out", required=True, help="Cache directory to create, or to resume; or an fsspec URL (s3://bucket/prefix, gs://...).")
@click.option("--layers", type=INT_LIST, help="Target layer indices to capture, e.g. 1,16,31,46,61 (0-based; layer i's output).")
@click.option("--num-draft-layers", type=int, help="Capture N layers spread evenly from 1 to num_layers-3 (the reference DFlash rule). Default 5 when --layers is not given.")
@click.option("--codec", type=click.Choice(CODECS), default="bf16-zstd", show_default=True, help="bf16-zstd and bf16 are lossless; fp8-zstd is lossy, about 0.6x the bytes.")
@click.option("--gpus", type=INT_LIST, help="GPUs to use, one process each, e.g. 0-4. Default: every visible GPU; the CPU when there is none.")
@click.option("--token-budget", type=int, default=49152, show_default=True, help="Tokens (with padding) per target forward.")
@click.option("--max-length", type=int, default=8192, show_default=True, help="Longer samples are truncated (counted in the summary and manifest).")
@click.option("--topk", type=int, default=0, show_default=True, help="Also store the target's top-K ids and log-probs per position.")
@click.option("--on-bad-sample", type=click.Choice(["error", "skip"]), default="error", show_default=True, help="A sample with NaN/Inf or an all-zero layer: stop, or skip it and list it in the manifest.")
@click.option("--shard-size", type=float, default=512, show_default=True, help="Shard size in MiB (a shard is closed once it reaches this size).")
@click.option("--staging", type=click.Path(path_type=Path), help="With a URL --out: local folder for shards until they are uploaded. Default: under the temp folder.")
@click.option("--tokenize-workers", type=click.IntRange(min=0), default=0, help="Processes for tokenizing conversations (0: in the main process).")
def command(target, data, out, layers, num_draft_layers, codec, gpus, token_budget, max_length, topk, on_bad_sample, shard_size, staging, tokenize_workers):
    """Run the target once over the data and write its hidden states to a cache.

    Rerunning the same command after any interruption resumes without recomputing committed samples.
    """
    from dflash_cache.extract.pipeline import ExtractOptions, extract

    if layers is None and num_draft_layers is None:
        num_draft_layers = 5
    if shard_size <= 0:
        raise click.BadParameter("must be positive", param_hint="--shard-size")
    opts = ExtractOptions(
        target=target, data=list(data), out=out, layers=layers, num_draft_layers=num_draft_layers, codec=codec,
        gpus=gpus, token_budget=token_budget, max_length=max_length, topk=topk, on_bad_sample=on_bad_sample,
        max_shard_bytes=int(shard_size * (1 << 20)), tokenize_workers=tokenize_workers, staging=staging,
    )
    bar = log = None
    written = [0, 0.0]  # bytes, seconds waiting on the disk

    def on_plan(samples: int, tokens: int) -> None:
        nonlocal bar, log
        if not samples:
            return
        click.echo(f"to extract: {samples} samples, {tokens} tokens", err=True)
        if sys.stderr.isatty():
            bar = tqdm(total=tokens, unit="tok", unit_scale=True, desc="extract", dynamic_ncols=True)
        else:  # a log file: tqdm would print nothing
            log = ProgressLog("extract", samples, tokens, lambda line: click.echo(line, err=True)).start()

    def on_progress(p) -> None:
        written[0] += p.bytes
        written[1] += p.wait_s
        if log is not None:
            log.update(p.samples, p.tokens, p.bytes)
        if bar is not None:
            bar.update(p.tokens)
            waiting = " (waiting on disk)" if p.wait_s > 0.1 else ""
            bar.set_postfix_str(f"{written[0] / 1e6:,.1f} MB written{waiting}", refresh=False)

    try:
        summary = extract(opts, on_progress, on_plan)
    finally:
        if log is not None:
            log.close()
    if bar is not None:
        bar.close()
    if summary.already_complete:
        click.echo(f"{out}: already complete, nothing to do")
        return
    per_token = summary.bytes / max(summary.tokens, 1)
    click.echo(
        f"done: {summary.samples} samples, {summary.tokens} tokens, {per_token / 1024:.2f} KiB/token, "
        f"{summary.wall_s:.1f} s wall, {summary.truncated} truncated, {summary.skipped} skipped"
    )
    for r in summary.ranks:
        rate = r.tokens / max(r.compute_s, 1e-9)
        click.echo(f"  rank {r.rank}: {r.tokens} tokens, {rate:,.0f} tokens/s, {r.wait_s:.1f} s waiting on disk")
    if summary.manifest is None:
        click.echo("this rank is done; the manifest is written by the last rank to finish")
