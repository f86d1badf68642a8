import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from tqdm import tqdm

from dflash_cache.choices import CODECS
from dflash_cache.progress import ProgressLog
from dflash_cache.store.subspace import SubspaceOptions
from dflash_cache_cli.options import INT_LIST, LAYER_RULE

if TYPE_CHECKING:
    from dflash_cache.extract.pipeline import ExtractSummary
    from dflash_cache.extract.worker import RankSummary


@click.command("extract")
@click.option(
    "--target",
    required=True,
    type=click.Path(path_type=Path),
    help="Hugging Face model directory of the target (loaded in bf16).",
)
@click.option(
    "--data",
    required=True,
    multiple=True,
    type=click.Path(path_type=Path),
    help="Conversations JSONL ({'messages': [...]} or ShareGPT {'conversations': [...]}), or pre-tokenized Parquet/Arrow/JSONL with input_ids (and loss_mask). Repeatable.",
)
@click.option(
    "--out",
    required=True,
    help="Cache directory to create, or to resume; or an fsspec URL (s3://bucket/prefix, gs://...).",
)
@click.option(
    "--layers", type=INT_LIST, help="Target layer indices to capture, e.g. 1,16,31,46,61 (0-based; layer i's output)."
)
@click.option("--num-draft-layers", type=int, help=LAYER_RULE)
@click.option(
    "--codec",
    type=click.Choice(CODECS),
    default="bf16-zstd",
    show_default=True,
    help="bf16-zstd and bf16 are lossless; fp8-zstd is lossy, about 0.6x the bytes; fp4 and fp4-zstd "
    "(4-bit values with a scale per 16) are lossier, about 0.28x. subspace-C stores each token's "
    "coordinates on a basis fitted to --subspace-sample, coded by C.",
)
@click.option(
    "--skip-disk-check",
    is_flag=True,
    help="Start even when the output's file system looks too small for the cache (the estimate is stated either way).",
)
@click.option(
    "--subspace-sample",
    type=click.Path(path_type=Path),
    help="subspace codecs: a cache of this target and layers (e.g. a small bf16-zstd extraction) whose states the basis is fitted on.",
)
@click.option(
    "--subspace-rank",
    type=int,
    help="subspace codecs: coordinates a token keeps (a multiple of 64); default: as many as --subspace-energy needs.",
)
@click.option(
    "--subspace-energy",
    type=float,
    help=f"subspace codecs: share of a token's sum of squares the coordinates keep, on average over the sample (default {SubspaceOptions.energy}).",
)
@click.option(
    "--gpus",
    type=INT_LIST,
    help="GPUs to use, one process each, e.g. 0-4. Default: every visible GPU; the CPU when there is none.",
)
@click.option(
    "--token-budget",
    type=int,
    help="Tokens (with padding) per target forward. Packed rows hold max(this, the longest sample) tokens. Default: 49152 on a GPU, 4096 on the CPU.",
)
@click.option(
    "--max-length",
    type=int,
    default=8192,
    show_default=True,
    help="Longer samples are truncated (counted in the summary and manifest).",
)
@click.option(
    "--topk",
    type=int,
    default=0,
    show_default=True,
    help="Also store the target's top-K ids and log-probs per position.",
)
@click.option(
    "--on-bad-sample",
    type=click.Choice(["error", "skip"]),
    default="error",
    show_default=True,
    help="A sample with NaN/Inf or an all-zero layer: stop, or skip it and list it in the manifest.",
)
@click.option(
    "--shard-size",
    type=float,
    default=512,
    show_default=True,
    help="Shard size in MiB (a shard is closed once it reaches this size).",
)
@click.option(
    "--staging",
    type=click.Path(path_type=Path),
    help="With a URL --out: local folder for shards until they are uploaded. Default: under the temp folder.",
)
@click.option(
    "--tokenize-workers",
    type=click.IntRange(min=0),
    help="Processes tokenizing the data (0 or 1: the main process). Default: one per CPU core.",
)
@click.option(
    "--tokenized-dir",
    type=click.Path(path_type=Path),
    help="Where the tokenized data is kept, to be reused by resumed and later extractions of the same data, "
    "tokenizer and --max-length (an Arrow file that --data also reads). Default: "
    "$DFLASH_CACHE_TOKENIZED_DIR, else ~/.cache/dflash-cache/tokenized.",
)
@click.option(
    "--on-bad-record",
    type=click.Choice(["error", "skip"]),
    default="error",
    show_default=True,
    help="A malformed line, a record with nothing to train on or a chat-template error: stop naming file:line, or skip it (counted, and listed with file:line and reason in the manifest).",
)
@click.option(
    "--chat-template-kwargs",
    "chat_template_kwargs",
    metavar="JSON",
    help="Extra chat-template options as a JSON object, e.g. '{\"enable_thinking\": false}' (part of the cache spec).",
)
@click.option(
    "--strict-template",
    is_flag=True,
    help="A conversation whose rendered turns differ from what generation sees (prompts that are not prefixes, no end-of-turn token) is a bad record, not a warning (a template that leaves out reasoning or tool calls always makes one).",
)
@click.option(
    "--max-record-bytes",
    type=click.IntRange(min=1),
    help="JSONL lines longer than this are bad records, refused unread. Default: 256 bytes per --max-length token, at least 4 MiB.",
)
@click.option(
    "--batching",
    type=click.Choice(["auto", "packed", "padded"]),
    default="auto",
    show_default=True,
    help="packed: samples concatenated into rows of one fixed size, each sample seeing only itself (qwen3, qwen3_5, qwen2, llama); "
    "padded: one sample per row, on a few fixed shapes; auto: packed where the target supports it.",
)
@click.option(
    "--kernel-cache",
    type=click.Path(path_type=Path),
    help="Folder for compiled and autotuned kernels, kept between runs and shared by the ranks of a node (sets TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR). Default: Triton's own cache.",
)
@click.option(
    "--skip-weights-hash",
    is_flag=True,
    help="Identify the target's weights by their sizes, safetensors headers and 1 MiB sampled from each file, instead of hashing every byte once (recorded in the cache spec).",
)
def command(
    target,
    data,
    out,
    layers,
    num_draft_layers,
    codec,
    gpus,
    token_budget,
    max_length,
    topk,
    on_bad_sample,
    shard_size,
    staging,
    tokenize_workers,
    tokenized_dir,
    on_bad_record,
    chat_template_kwargs,
    strict_template,
    max_record_bytes,
    batching,
    kernel_cache,
    skip_weights_hash,
    subspace_sample,
    subspace_rank,
    subspace_energy,
    skip_disk_check,
):
    """Run the target once over the data and write its hidden states to a cache.

    Rerunning the same command after any interruption resumes without recomputing committed samples.
    """
    from dflash_cache.extract.pipeline import ExtractOptions, extract

    if shard_size <= 0:
        raise click.BadParameter("must be positive", param_hint="--shard-size")
    template_kwargs = _json_object(chat_template_kwargs)
    opts = ExtractOptions(
        target=target,
        data=list(data),
        out=out,
        layers=layers,
        num_draft_layers=num_draft_layers,
        codec=codec,
        gpus=gpus,
        token_budget=token_budget,
        max_length=max_length,
        topk=topk,
        on_bad_sample=on_bad_sample,
        max_shard_bytes=int(shard_size * (1 << 20)),
        tokenize_workers=tokenize_workers,
        staging=staging,
        on_bad_record=on_bad_record,
        chat_template_kwargs=template_kwargs,
        strict_template=strict_template,
        max_record_bytes=max_record_bytes,
        tokenized_dir=tokenized_dir,
        batching=batching,
        kernel_cache=kernel_cache,
        hash_weights=not skip_weights_hash,
        check_disk=not skip_disk_check,
        subspace=None
        if subspace_sample is None
        else SubspaceOptions(
            subspace_sample,
            rank=subspace_rank,
            **({} if subspace_energy is None else {"energy": subspace_energy}),
        ),
    )
    bar = log = None
    written = [0, 0.0]  # bytes, seconds waiting on the disk
    terminal = sys.stderr.isatty()

    def on_tokenize(samples: int, tokens: int) -> None:
        nonlocal bar, log
        if bar is None and log is None:
            click.echo("tokenizing the data (kept for later runs)", err=True)
            if terminal:
                bar = tqdm(unit="sample", desc="tokenize", dynamic_ncols=True)
            else:
                log = ProgressLog("tokenize", None, None, lambda line: click.echo(line, err=True), writes=False).start()
        if bar is not None:
            bar.update(samples)
        else:
            log.update(samples, tokens)

    def close_progress() -> None:
        nonlocal bar, log
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
        bar = log = None

    def on_data(loaded) -> None:
        if loaded.bad_records:
            first = loaded.bad_records[0]
            click.echo(
                f"skipped {len(loaded.bad_records)} bad records (listed in the manifest), e.g. {first['where']}: {first['reason']}",
                err=True,
            )
        if loaded.untrainable:
            click.echo(
                f"skipped {len(loaded.untrainable)} samples with no assistant token within --max-length {max_length} "
                f"(listed in the manifest), e.g. {loaded.untrainable[0]['where']}",
                err=True,
            )
        if loaded.unfaithful:
            click.echo(
                f"warning: the chat template does not render {loaded.unfaithful} conversations as the data has them "
                f"(recorded in the manifest; --strict-template makes it an error), e.g. {loaded.unfaithful_examples[0]}",
                err=True,
            )

    def on_plan(samples: int, tokens: int, layout: str) -> None:
        nonlocal bar, log
        close_progress()  # tokenizing is over
        if not samples:
            return
        click.echo(f"to extract: {samples} samples, {tokens} tokens; the target runs {layout}", err=True)
        if terminal:
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
        summary = extract(
            opts, on_progress, on_plan, on_data, on_tokenize, on_note=lambda line: click.echo(f"note: {line}", err=True)
        )
    finally:
        close_progress()
    if bar is not None:
        bar.close()
    if summary.already_complete:
        click.echo(f"{out}: already complete, nothing to do")
        return
    click.echo(
        f"done: {held_line(summary)}, {summary.wall_s:.1f} s wall, {summary.truncated} truncated, "
        f"{summary.skipped if summary.manifest is None else len(summary.manifest['skipped'])} skipped, "
        f"{summary.bad_records} bad records, {summary.untrainable} with nothing to train on"
    )
    for r in summary.ranks:
        click.echo(rank_line(r))
    if summary.manifest is None:
        click.echo("this rank is done; the manifest is written by the last rank to finish")


def _json_object(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise click.BadParameter(
            f"not valid JSON ({e.msg} at column {e.colno})", param_hint="--chat-template-kwargs"
        ) from None
    if not isinstance(value, dict):
        raise click.BadParameter(
            "must be a JSON object, e.g. '{\"enable_thinking\": false}'", param_hint="--chat-template-kwargs"
        )
    return value or None


def held_line(summary: "ExtractSummary") -> str:
    """What the cache holds now, from its manifest, and this run's share of it after a resume; a
    torchrun rank that did not write the manifest knows only what it wrote itself."""
    if summary.manifest is None:
        return (
            f"{summary.samples:,} samples, {summary.tokens:,} tokens written by this rank, "
            f"{summary.bytes / max(summary.tokens, 1):,.0f} bytes/token"
        )
    totals = summary.manifest["totals"]
    resumed = summary.samples != totals["samples"]
    return (
        f"{totals['samples']:,} samples{f' ({summary.samples:,} this run)' if resumed else ''}, "
        f"{totals['tokens']:,} tokens{f' ({summary.tokens:,} this run)' if resumed else ''}, "
        f"{totals['bytes'] / max(totals['tokens'], 1):,.0f} bytes/token"
    )


def rank_line(r: "RankSummary") -> str:
    """The summary line of one rank (benchmarks/extract_cold.py reads it)."""
    rate = r.tokens / max(r.compute_s, 1e-9)
    warm_up = "compiling kernels" if r.on_gpu else "on a warm-up forward"
    return (
        f"  rank {r.rank}: {r.tokens:,} tokens, {rate:,.0f} tokens/s, {r.compile_s:.1f} s {warm_up} "
        f"before the first batch, {r.wait_s:.1f} s waiting on disk"
    )
