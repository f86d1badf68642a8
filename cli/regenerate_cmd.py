import json
import sys
import threading
import time
from pathlib import Path

import click
from tqdm import tqdm

from dflash_cache.console.progress import duration
from dflash_cache.console.terminate import sigterm_raises
from dflash_cache.regenerate.run import RecordDone, RegenerateOptions, regenerate
from dflash_cache.regenerate.settings import REASONING, TURNS, GenerationSettings
from dflash_cache_cli.options import INT_LIST

LOG_EVERY_S = 30.0  # a plain progress line this often when stderr is not a terminal
REFRESH_S = 1.0  # the bar's token count redrawn this often between records
# tqdm's own ETA is from records a second: wrong while long answers run, so the postfix carries ours.
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} records [{elapsed}{postfix}]"


class Progress:
    """A bar on a terminal; otherwise one line every LOG_EVERY_S seconds, for logs. Both count the
    tokens as the target reports them (the in-process target each step, a server with each answer),
    so they move while long answers run."""

    def __init__(self, todo: int, done: int):
        self.todo, self.records, self.tokens, self.record_tokens = todo, 0, 0, 0
        self.started = time.perf_counter()
        self._lock = threading.Lock()  # tokens come from the target's threads
        click.echo(f"to regenerate: {todo} records ({done} already in the output)", err=True)
        self.bar = tqdm(total=todo, desc="regenerate", bar_format=BAR_FORMAT, disable=None, file=sys.stderr)
        self._stop = threading.Event()
        threading.Thread(target=self._tick, daemon=True).start()

    def generated(self, tokens: int) -> None:
        with self._lock:
            self.tokens += tokens

    def update(self, record: RecordDone) -> None:
        with self._lock:
            self.records += 1
            self.record_tokens += record.tokens
        self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.update(1)

    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.started, 1e-9)

    def eta(self) -> float | None:
        """Seconds left: the records left at the mean tokens of those done, at the rate so far (None
        before a record is done). Records under way count as left: their tokens so far are not known
        apart."""
        with self._lock:
            if not self.records:
                return None
            left = self.record_tokens / self.records * (self.todo - self.records)
        rate = self.rate()
        return left / rate if rate > 0 else None

    def postfix(self, elapsed: bool = False) -> str:
        eta = self.eta()
        parts = [f"{self.tokens:,} tokens", f"{self.rate():,.0f} tokens/s"]
        if elapsed:
            parts.append(f"{duration(time.perf_counter() - self.started)} elapsed")
        parts.append(f"ETA {duration(eta) if eta is not None else 'unknown'}")
        return ", ".join(parts)

    def line(self) -> str:
        return f"regenerate: {self.records}/{self.todo} records, {self.postfix(elapsed=True)}"

    def _tick(self) -> None:
        while not self._stop.wait(LOG_EVERY_S if self.bar.disable else REFRESH_S):
            if self.bar.disable:
                click.echo(self.line(), err=True)
            else:
                self.bar.set_postfix_str(self.postfix())

    def close(self) -> None:
        self._stop.set()
        self.bar.close()


def _json_object(ctx, param, value):
    if value is None:
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return parsed


@click.command("regenerate")
@click.option(
    "--data",
    required=True,
    multiple=True,
    type=click.Path(path_type=Path),
    help="Conversation files, as extract reads them ({'messages': [...]} or ShareGPT JSONL); a conversation "
    "without an assistant turn is a prompt, answered by the target. Repeatable.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Output JSONL (messages form); an existing one is resumed.",
)
@click.option(
    "--server",
    "servers",
    multiple=True,
    help="OpenAI-compatible endpoint, e.g. http://host:8000 (vllm serve, SGLang, transformers serve). Repeat to split the work.",
)
@click.option(
    "--target",
    type=click.Path(path_type=Path),
    help="Instead of --server: a Hugging Face model directory run in-process (small jobs, tests).",
)
@click.option(
    "--gpus",
    type=INT_LIST,
    help="With --target: GPUs to use, one model replica each. Default: every visible GPU; the CPU when there is none.",
)
@click.option(
    "--max-tokens", type=int, default=4096, show_default=True, help="Most tokens generated per assistant turn."
)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy.")
@click.option("--concurrency", type=int, default=64, show_default=True, help="Requests in flight, over all servers.")
@click.option(
    "--reasoning",
    type=click.Choice(REASONING),
    default="auto",
    show_default=True,
    help="Thinking for reasoning targets: the chat template's default, or enable_thinking on/off.",
)
@click.option(
    "--turns",
    type=click.Choice(TURNS),
    default="all",
    show_default=True,
    help="Regenerate every assistant turn (later ones see the new earlier ones), or only the last.",
)
@click.option(
    "--chat-template-kwargs",
    callback=_json_object,
    help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'.",
)
@click.option(
    "--limit", type=click.IntRange(min=1), help="Only the first N conversations of the data files. Default: all."
)
@click.option(
    "--on-error",
    type=click.Choice(["error", "skip"]),
    default="error",
    show_default=True,
    help="A request that keeps failing: stop, or skip its record and list it (a rerun retries it).",
)
def command(
    data,
    out,
    servers,
    target,
    gpus,
    max_tokens,
    temperature,
    concurrency,
    reasoning,
    turns,
    chat_template_kwargs,
    limit,
    on_error,
):
    """Answer the conversations again with the target, so the drafter trains on what the target says.

    Rerunning the same command after any interruption resumes: records already written are not asked for again.
    """
    settings = GenerationSettings(
        max_tokens=max_tokens,
        temperature=temperature,
        reasoning=reasoning,
        turns=turns,
        chat_template_kwargs=chat_template_kwargs,
    )
    opts = RegenerateOptions(
        data=list(data),
        out=out,
        servers=list(servers),
        target=target,
        gpus=gpus,
        settings=settings,
        concurrency=concurrency,
        on_error=on_error,
        limit=limit,
    )
    progress: list[Progress] = []
    try:
        with sigterm_raises():  # so that a run killed before its first record leaves no --out file
            summary = regenerate(
                opts,
                on_start=lambda todo, done: progress.append(Progress(todo, done)) if todo else None,
                on_record=lambda record: progress[0].update(record),
                on_tokens=lambda tokens: progress[0].generated(tokens),
            )
    finally:
        for p in progress:
            p.close()
    if summary.cut_bytes:
        click.echo(
            f"cut a torn last line ({summary.cut_bytes} bytes) left by an interrupted run; its record was asked for again"
        )
    if not summary.records and not summary.skipped:
        click.echo(f"{out}: all {summary.already_done} records already regenerated, nothing to do")
        return
    rate = summary.tokens / max(summary.wall_s, 1e-9)
    click.echo(
        f"done: {summary.records} records written ({summary.already_done} were already there), {summary.turns} turns, "
        f"{summary.tokens:,} tokens in {summary.wall_s:.1f} s ({rate:,.0f} tokens/s) -> {out}"
    )
    reasons = ", ".join(f"{reason} {count}" for reason, count in summary.finish_reasons.most_common())
    length = summary.finish_reasons.get("length", 0)
    click.echo(f"finish reasons: {reasons}; {length} turn(s) hit --max-tokens {max_tokens}")
    click.echo(
        f"failures: {len(summary.skipped)} record(s) skipped"
        + (" (rerun the same command to retry them):" if summary.skipped else "")
    )
    for source, why in summary.skipped:
        click.echo(f"  {source}: {why}")
