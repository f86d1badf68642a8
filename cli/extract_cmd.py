import sys
from typing import TYPE_CHECKING

import click
from tqdm import tqdm

from dflash_cache.console.progress import ProgressLog
from dflash_cache.extract.events import ExtractEvents
from dflash_cache.extract.options import ExtractOptions
from dflash_cache_cli.options import config_options

if TYPE_CHECKING:
    from dflash_cache.data.dataset import LoadedData
    from dflash_cache.extract.pipeline import ExtractSummary
    from dflash_cache.extract.worker import Progress, RankSummary


@click.command("extract")
@config_options(ExtractOptions)
def command(**options):
    """Run the target once over the data and write its hidden states to a cache.

    Rerunning the same command after any interruption resumes without recomputing committed samples.
    """
    from dflash_cache.extract.pipeline import extract

    opts = ExtractOptions(**options)
    display = _Display(opts.max_length, terminal=sys.stderr.isatty())
    try:
        summary = extract(opts, display)
    finally:
        display.close()
    if summary.already_complete:
        click.echo(f"{opts.out}: already complete, nothing to do")
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


class _Display(ExtractEvents):
    """Tokenizing and extraction progress as a bar on a terminal, as lines in a log."""

    def __init__(self, max_length: int, terminal: bool):
        self.max_length = max_length
        self.terminal = terminal
        self.bar: tqdm | None = None
        self.log: ProgressLog | None = None
        self.written = 0  # bytes

    def tokenize(self, samples: int, tokens: int) -> None:
        if self.bar is None and self.log is None:
            click.echo("tokenizing the data (kept for later runs)", err=True)
            if self.terminal:
                self.bar = tqdm(unit="sample", desc="tokenize", dynamic_ncols=True)
            else:
                self.log = ProgressLog("tokenize", None, None, _echo_err, writes=False).start()
        if self.bar is not None:
            self.bar.update(samples)
        else:
            self.log.update(samples, tokens)

    def data(self, loaded: "LoadedData") -> None:
        if loaded.bad_records:
            first = loaded.bad_records[0]
            click.echo(
                f"skipped {len(loaded.bad_records)} bad records (listed in the manifest), e.g. {first['where']}: {first['reason']}",
                err=True,
            )
        if loaded.untrainable:
            click.echo(
                f"skipped {len(loaded.untrainable)} samples with no assistant token within --max-length {self.max_length} "
                f"(listed in the manifest), e.g. {loaded.untrainable[0]['where']}",
                err=True,
            )
        if loaded.unfaithful:
            click.echo(
                f"warning: the chat template does not render {loaded.unfaithful} conversations as the data has them "
                f"(recorded in the manifest; --strict-template makes it an error), e.g. {loaded.unfaithful_examples[0]}",
                err=True,
            )

    def plan(self, samples: int, tokens: int, layout: str) -> None:
        self.close()  # tokenizing is over
        if not samples:
            return
        click.echo(f"to extract: {samples} samples, {tokens} tokens; the target runs {layout}", err=True)
        if self.terminal:
            self.bar = tqdm(total=tokens, unit="tok", unit_scale=True, desc="extract", dynamic_ncols=True)
        else:  # a log file: tqdm would print nothing
            self.log = ProgressLog("extract", samples, tokens, _echo_err).start()

    def progress(self, progress: "Progress") -> None:
        self.written += progress.bytes
        if self.log is not None:
            self.log.update(progress.samples, progress.tokens, progress.bytes)
        if self.bar is not None:
            self.bar.update(progress.tokens)
            waiting = " (waiting on disk)" if progress.wait_s > 0.1 else ""
            self.bar.set_postfix_str(f"{self.written / 1e6:,.1f} MB written{waiting}", refresh=False)

    def note(self, line: str) -> None:
        click.echo(f"note: {line}", err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            self.log.close()
        self.bar = self.log = None


def _echo_err(line: str) -> None:
    click.echo(line, err=True)


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
