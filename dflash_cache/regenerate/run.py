"""`regenerate`: every conversation of the data files answered again by the target, written to JSONL.

    data files (the first --limit conversations) -> conversations not yet in the output -> a bounded queue -> N worker threads, each
    regenerating one conversation at a time (one request per assistant turn, in order) -> the main
    thread appends each finished record, as one fsynced line, in the order they finish

A record carries its source (`file:line`), the generation settings and the model that answered,
and what each regenerated turn ended with. A request that fails for good stops the run (the records
written so far stay; rerunning resumes) or, with on_error="skip", skips its record, which is listed
in the summary and asked for again by the next run.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_cache.errors import DFlashCacheError
from dflash_cache.regenerate.answers import AnswerLimits
from dflash_cache.regenerate.client import RequestFailed, RetryPolicy, ServerPool
from dflash_cache.regenerate.conversations import (
    Completion,
    Job,
    read_jobs,
    regenerate_conversation,
    turns_to_regenerate,
)
from dflash_cache.regenerate.output import ResponsesFile
from dflash_cache.regenerate.settings import GenerationSettings


@dataclass
class RegenerateOptions:
    data: list[Path]
    out: Path
    servers: list[str] = field(default_factory=list)  # OpenAI-compatible endpoints; or
    target: Path | None = None  # a model directory run in-process
    gpus: list[int] | None = None  # with target: None = every visible GPU, or the CPU when there is none
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    concurrency: int = 64  # requests in flight (conversations being regenerated at once)
    on_error: str = "error"  # a request that keeps failing: "error" stops the run, "skip" skips its record
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    limits: AnswerLimits = field(default_factory=AnswerLimits)  # the bytes and seconds an answer may take
    limit: int | None = None  # only the first N conversations of the data files (None: all)


@dataclass
class RecordDone:
    source: str
    tokens: int  # generated in this record
    finish_reasons: list[str]


@dataclass
class RegenerateSummary:
    records: int = 0  # written by this run
    already_done: int = 0  # found in the output from an earlier run
    turns: int = 0
    tokens: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (source, why)
    cut_bytes: int = 0  # a torn last line from an interrupted run, cut off
    wall_s: float = 0.0


def _check(opts: RegenerateOptions) -> None:
    if bool(opts.servers) == (opts.target is not None):
        raise DFlashCacheError("give either --server (one or more) or --target, not both and not neither")
    if opts.gpus is not None and opts.target is None:
        raise DFlashCacheError("--gpus is for --target; a server chooses its own GPUs")
    if opts.concurrency < 1:
        raise DFlashCacheError(f"--concurrency must be at least 1, not {opts.concurrency}")
    if opts.limit is not None and opts.limit < 1:
        raise DFlashCacheError(f"--limit must be at least 1, not {opts.limit}")
    if opts.on_error not in ("error", "skip"):
        raise DFlashCacheError(f"--on-error must be error or skip, not {opts.on_error!r}")
    resolved = [Path(p).resolve() for p in opts.data]
    if not resolved:
        raise DFlashCacheError("give at least one --data file")
    if len(set(resolved)) != len(resolved):
        raise DFlashCacheError("a --data file is given twice")
    if Path(opts.out).resolve() in resolved:
        raise DFlashCacheError(f"--out {opts.out} is also a --data file; write the responses to a new file")


def _backend(opts: RegenerateOptions, stopping: threading.Event, on_tokens: Callable[[int], None]):
    if opts.servers:
        pool = ServerPool(opts.servers, opts.concurrency, opts.retry, stopping, opts.limits, on_tokens)
        pool.probe()
        return pool
    from dflash_cache.regenerate.local import LocalTarget  # loads torch models: only when asked for
    from dflash_cache.train.distributed import plan_devices

    return LocalTarget(opts.target, plan_devices(opts.gpus, 0), on_tokens=on_tokens)


def regenerate(
    opts: RegenerateOptions,
    on_start: Callable[[int, int], None] = lambda todo, done: None,
    on_record: Callable[[RecordDone], None] = lambda record: None,
    on_tokens: Callable[[int], None] = lambda n: None,
) -> RegenerateSummary:
    """Regenerate what the output lacks; `on_start(records to do, records already done)`, `on_tokens(n)`
    from any thread as n more tokens are generated (by the in-process target as it generates them, by
    a server with each answer)."""
    started = time.perf_counter()
    _check(opts)
    sources = [
        job.source for job in read_jobs(opts.data, opts.limit)
    ]  # reads (and checks) every record before any request
    summary = RegenerateSummary()
    with ResponsesFile(opts.out, opts.settings) as out:
        summary.cut_bytes = out.cut_bytes
        summary.already_done = sum(source in out.done for source in sources)
        todo = len(sources) - summary.already_done
        on_start(todo, summary.already_done)
        if todo:
            stopping = threading.Event()
            backend = _backend(opts, stopping, on_tokens)
            try:
                _Lanes(opts, out, backend, stopping, min(opts.concurrency, todo)).run(summary, on_record)
            finally:
                stopping.set()
                backend.close()
    summary.wall_s = time.perf_counter() - started
    return summary


class _Lanes:
    """`workers` threads each regenerating one conversation at a time, fed by one thread reading the
    data; this thread writes their results in the order they finish."""

    def __init__(self, opts: RegenerateOptions, out: ResponsesFile, backend, stopping: threading.Event, workers: int):
        self.opts, self.out, self.backend, self.stopping, self.workers = opts, out, backend, stopping, workers
        self.jobs: queue.Queue = queue.Queue(maxsize=2 * opts.concurrency)
        self.results: queue.Queue = queue.Queue()

    def run(self, summary: RegenerateSummary, on_record: Callable[[RecordDone], None]) -> None:
        threads = [threading.Thread(target=self._feed, name="regenerate-feed", daemon=True)]
        threads += [
            threading.Thread(target=self._work, args=(lane,), name=f"regenerate-{lane}", daemon=True)
            for lane in range(self.workers)
        ]
        for thread in threads:
            thread.start()
        exited = 0
        while exited < self.workers:
            kind, job, payload = self.results.get()
            if kind == "exit":
                exited += 1
            elif kind == "done":
                _write(self.out, job, self.opts.settings, *payload, summary, on_record)
            elif kind == "failed" and self.opts.on_error == "skip":
                summary.skipped.append((job.source, payload))
            elif kind == "failed":
                raise DFlashCacheError(f"{job.source}: {payload}; {_resume_hint(summary)}")
            else:
                raise payload

    def _feed(self) -> None:
        pending = (job for job in read_jobs(self.opts.data, self.opts.limit) if job.source not in self.out.done)
        try:
            for item in itertools.chain(pending, [None] * self.workers):  # then one end mark per worker
                while not _put(self.jobs, item):
                    if self.stopping.is_set():
                        return
        except BaseException as e:  # noqa: BLE001 - a data file that changed under us: re-raised by the main thread
            self.results.put(("crashed", None, e))

    def _work(self, lane: int) -> None:
        settings = self.opts.settings

        def complete(messages: list[dict]) -> Completion:
            return self.backend.complete(messages, settings, lane)

        while (job := self.jobs.get()) is not None and not self.stopping.is_set():
            try:
                self.results.put(("done", job, regenerate_conversation(job.messages, settings.turns, complete)))
            except RequestFailed as e:
                if self.opts.on_error != "skip":  # the run stops on it: no lane may send another request
                    self.stopping.set()
                self.results.put(("failed", job, str(e)))
            except BaseException as e:  # noqa: BLE001 - re-raised by the main thread
                self.results.put(("crashed", job, e))
        self.results.put(("exit", None, None))


def _write(
    out: ResponsesFile,
    job: Job,
    settings: GenerationSettings,
    messages: list[dict],
    completions: list[Completion],
    summary: RegenerateSummary,
    on_record: Callable[[RecordDone], None],
) -> None:
    model = completions[0].model
    for completion in completions:
        expected = out.model or model
        if completion.model != expected:
            why = f"{out.path} was written by" if out.model else "another answer of this run came from"
            raise DFlashCacheError(
                f"{job.source}: answered by model {completion.model!r}, but {why} {expected!r}; "
                "every --server must serve the same model"
            )
    out.model = model
    out.append(
        {
            **({"id": job.record_id} if job.record_id is not None else {}),
            "messages": messages,
            "source": job.source,
            "generation": {**settings.to_dict(), "model": model},
            "regenerated": [
                {"turn": turn, "finish_reason": c.finish_reason, "completion_tokens": c.completion_tokens}
                for turn, c in zip(turns_to_regenerate(job.messages, settings.turns), completions)
            ],
        }
    )
    tokens = sum(c.completion_tokens for c in completions)
    summary.records += 1
    summary.turns += len(completions)
    summary.tokens += tokens
    summary.finish_reasons.update(c.finish_reason for c in completions)
    on_record(RecordDone(job.source, tokens, [c.finish_reason for c in completions]))


def _put(jobs: queue.Queue, item: Job | None) -> bool:
    try:
        jobs.put(item, timeout=0.5)
        return True
    except queue.Full:
        return False


def _resume_hint(summary: RegenerateSummary) -> str:
    return f"{summary.records} record(s) written this run; rerun the same command to resume (or --on-error skip)"
