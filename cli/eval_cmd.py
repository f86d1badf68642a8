import sys
import time
from pathlib import Path

import click
from tqdm import tqdm

from dflash_cache.choices import TARGET_DTYPES
from dflash_cache.console.progress import duration


def progress(bar: tqdm, unit: str):
    """A bar on a terminal; otherwise one line per step done, with the ETA, for logs."""
    started = time.monotonic()

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        if bar.disable and done:
            elapsed = time.monotonic() - started
            click.echo(
                f"eval: {done}/{total} {unit}, {duration(elapsed)} elapsed, "
                f"ETA {duration(elapsed / done * (total - done))}",
                err=True,
            )

    return update


@click.command("eval")
@click.option(
    "--drafter",
    required=True,
    type=click.Path(path_type=Path),
    help="A training checkpoint (RUN/checkpoints/step-N), a training run folder (its newest checkpoint), "
    "or an export (`dflash-cache export`).",
)
@click.option(
    "--target",
    type=click.Path(path_type=Path),
    help="Target model directory: real speculative decoding on the prompts of --data.",
)
@click.option(
    "--data",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Held-out conversations (or pre-tokenized records): each one's prompt is everything before its "
    "first assistant turn, or the whole conversation where it has none. Repeatable.",
)
@click.option("--max-new-tokens", type=int, help="Tokens to generate per prompt. Default: 128 on a GPU, 64 on the CPU.")
@click.option(
    "--num-prompts",
    "--limit",
    "num_prompts",
    type=click.IntRange(min=0),
    help="Prompts to decode: those of the first N records (0: every one). Default: 16 on a GPU, 8 on the CPU.",
)
@click.option(
    "--dtype",
    type=click.Choice(TARGET_DTYPES),
    default="float32",
    show_default=True,
    help="Target precision. bf16 near-ties can flip an argmax between the two decodings and fail the check.",
)
@click.option(
    "--cache",
    "caches",
    multiple=True,
    help="Instead of --target: tau offline from this cache's hidden states (a folder or an fsspec URL), "
    "as training evaluates it.",
)
@click.option(
    "--eval-fraction",
    type=click.FloatRange(0, 1, max_open=True),
    help="With --cache: only the samples a training run with this --eval-fraction holds out (0: all). "
    "Default: the drafter's own run's held-out split (all samples for an export).",
)
@click.option(
    "--token-budget",
    type=int,
    help="With --cache: tokens per batch. Default: the run's (49152 on a GPU, 2048 on the CPU for an export).",
)
@click.option(
    "--max-anchors",
    type=int,
    help="With --cache: most blocks per sequence. Default: the run's (512 on a GPU, 8 on the CPU for an export).",
)
@click.option(
    "--seed", type=int, help="With --cache: seed of the plan and anchors. Default: the run's (0 for an export)."
)
@click.option("--device", help="Device, e.g. cuda:1 or cpu. Default: cuda:0 when there is a GPU.")
def command(
    drafter,
    target,
    data,
    max_new_tokens,
    num_prompts,
    dtype,
    caches,
    eval_fraction,
    token_budget,
    max_anchors,
    seed,
    device,
):
    """Evaluate a drafter: speculative decoding with its target (--target, --data), or offline (--cache).

    With --target every output is checked against the target's own greedy output; the command fails
    if one differs. Reports tau (mean acceptance length), acceptance per draft position and tokens
    per target forward.
    """
    from dflash_cache.eval import OfflineOptions, SpeculativeOptions, evaluate_offline, evaluate_speculative
    from dflash_cache.eval.speculative import speculative_defaults

    if bool(target) == bool(caches):
        raise click.UsageError("give either --target with --data (speculative decoding) or --cache (offline)")
    if caches:
        opts = OfflineOptions(
            drafter=drafter,
            caches=list(caches),
            eval_fraction=eval_fraction,
            token_budget=token_budget,
            max_anchors=max_anchors,
            seed=seed,
            device=device,
        )
        with tqdm(unit="batch", desc="eval", disable=None, file=sys.stderr) as bar:
            report = evaluate_offline(opts, progress(bar, "batches"))
    else:
        if not data:
            raise click.UsageError("--target needs --data with held-out prompts")
        prompts_default, tokens_default = speculative_defaults(device)
        num_prompts = prompts_default if num_prompts is None else num_prompts
        opts = SpeculativeOptions(
            drafter=drafter,
            target=target,
            data=list(data),
            max_new_tokens=tokens_default if max_new_tokens is None else max_new_tokens,
            num_prompts=num_prompts or None,
            device=device,
            dtype=dtype,
        )
        with tqdm(unit="prompt", desc="eval", disable=None, file=sys.stderr) as bar:
            report = evaluate_speculative(opts, progress(bar, "prompts"))
    click.echo(f"drafter {report.drafter}")
    for line in report.lines():
        click.echo(line)
