"""Training that follows a cache while its extraction still writes it (`train --follow`).

Only committed shards are read: those the journals list, which `ShardWriter` renames and journals
once whole, fsynced and hashed, and never changes after; each is verified against its journaled
sha256 on first read, as a finished cache's shards are against the manifest. The first epoch is
planned a shard at a time, in the order the shards were consumed: each newly committed shard's
samples (with the few left over from the shard before) are made into token-budget batches, and
the whole steps among them are trained on. That order is appended to the run folder's
`follow.jsonl` before the shard is trained on, so a resumed run replays the same parts and so the
same batches. Once the manifest exists and every shard it lists has been consumed, what is left
over is the last part, and from the second epoch on the plan is the ordinary one over every sample.

While nothing new is committed, the run waits, saying after `FIRST_STATUS_S` seconds and then every
`STATUS_EVERY_S` seconds whether an extraction holds the cache (its lock names its process) or none
does (it was killed or failed: rerun it); `--follow-timeout` bounds the wait. Under several ranks,
rank 0 alone looks at the cache and the clock, and every rank takes its answer each poll.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from dflash_cache.data.plan import plan_batches, shard_for_rank
from dflash_cache.errors import DFlashCacheError
from dflash_cache.files.lock import FolderLock
from dflash_cache.store.cache import Cache
from dflash_cache.store.manifest import (
    MANIFEST,
    JournalState,
    _check_width,
    read_journals,
    read_manifest,
    shard_record,
)
from dflash_cache.store.pool import ShardPool
from dflash_cache.store.remote import is_remote, local_path
from dflash_cache.store.shard import ShardRecord
from dflash_cache.stream.caches import CacheSet, is_held_out
from dflash_cache.stream.epochs import EpochPlan
from dflash_cache.train.distributed import all_gather_objects, is_first_rank

FOLLOW_FILE = "follow.jsonl"  # in the run folder: the shards of the first epoch, in the order consumed
POLL_S = 0.5
STATUS_EVERY_S = 30.0
FIRST_STATUS_S = 5.0  # a wait shorter than this (the next shard on its way) says nothing

Echo = Callable[[str], None]
T = TypeVar("T")


class Waiter:
    """Polls until something is ready, saying what it waits for and whether the extraction runs."""

    def __init__(self, root: Path, timeout_s: float | None, echo: Echo | None):
        self.root = root
        self.timeout_s = timeout_s
        self.echo = echo

    def extraction(self) -> str:
        holder = FolderLock(self.root, "cache").holder()
        if holder:
            return f"its extraction ({holder}) is running"
        return (
            "no extraction is running on it (killed or failed?): rerun the same extract command to go on; "
            "this run goes on when it commits shards"
        )

    def wait(self, what: str, ready: Callable[[], T | None]) -> T:
        """`ready()`'s first value that is not None. Under several ranks, rank 0 alone calls it (and keeps the
        time) and every rank takes its answer, so all of them see the same shards in the same order."""
        start = time.monotonic()
        said = start - STATUS_EVERY_S + FIRST_STATUS_S
        while True:
            outcome = None
            if is_first_rank():
                try:
                    value = ready()
                    if value is not None:
                        outcome = ("ok", value)
                    elif self.timeout_s is not None and time.monotonic() - start >= self.timeout_s:
                        outcome = (
                            "error",
                            f"--follow: nothing new in {self.root} for {self.timeout_s:g} s ({what}); "
                            f"{self.extraction()}; resume training with --resume once it does",
                        )
                except DFlashCacheError as e:
                    outcome = ("error", str(e))
            outcome = all_gather_objects(outcome)[0]
            if outcome is not None:
                if outcome[0] == "error":
                    raise DFlashCacheError(outcome[1])
                return outcome[1]
            now = time.monotonic()
            if self.echo is not None and now - said >= STATUS_EVERY_S:
                self.echo(f"following {self.root}: {what}; {self.extraction()}")
                said = now
            time.sleep(POLL_S)


class FollowedCache(CacheSet):
    """One cache read from its journals: its committed shards, added as they are consumed. Keys
    number the samples in the order their shards were consumed (row order within a shard)."""

    def __init__(self, path: str | Path, waiter: Waiter, max_open_shards: int | None):
        if is_remote(path):
            raise DFlashCacheError(f"--follow reads a local cache (or one on a shared file system); {path} is a URL")
        self.root = local_path(path)
        state = waiter.wait("waiting for the extraction to write the target head and journals", self._started)
        self.pool = ShardPool(max_open_shards)
        manifest = {"spec": state.spec, "shards": [], "target_files": state.target_files}
        self.caches = [Cache(self.root, pool=self.pool, verify_shards=True, manifest=manifest)]
        self.spec, self.codec, self.width = state.spec, self.caches[0].codec, self.caches[0].width
        self.entries: list[tuple[int, int]] = []
        self.lengths: list[int] = []

    def _started(self) -> JournalState | None:
        """The journals once they hold the spec and the target files' hashes (the head is written); else None,
        also while the folder is not there yet (an extraction started beside this run makes it)."""
        if not self.root.is_dir():
            return None
        state = read_journals(self.root)
        return state if state.spec is not None and state.target_files else None

    def add(self, shard: ShardRecord) -> list[int]:
        """Index a committed shard; returns its samples' keys."""
        try:
            _check_width(self.spec, [shard])
            if shard.num_tokens and max(shard.num_tokens) > self.spec["max_length"]:
                raise ValueError(f"shard {shard.path} lists a sample longer than max_length {self.spec['max_length']}")
        except ValueError as e:
            raise DFlashCacheError(f"{self.root}: journaled {e}") from None
        self.caches[0].add_shards([shard])
        first = len(self.entries)
        self.entries += [(0, sid) for sid in shard.sample_ids]
        self.lengths += shard.num_tokens
        return list(range(first, len(self.entries)))

    def committed(self) -> dict[str, ShardRecord]:
        """Every shard the journals list now, by path."""
        return {s.path: s for s in read_journals(self.root).shards}

    def finished_shards(self) -> set[str] | None:
        """The shards the manifest lists, once the extraction has written it; None before."""
        if not (self.root / MANIFEST).is_file():
            return None
        return {s.path for s in read_manifest(self.root)["shards"]}


@dataclass
class Part:
    batches: list[list[int]]  # global plan positions offset .. offset + len - 1, whole steps
    offset: int
    last: bool


class FollowPlan:
    """The epoch plan of a following run (see the module's docstring); `EpochPlan`'s interface in parts."""

    def __init__(
        self,
        caches: FollowedCache,
        run_dir: Path,
        token_budget: int,
        seed: int,
        world: int,
        grad_accum: int,
        eval_fraction: float,
        waiter: Waiter,
    ):
        """Rank 0 decides which shard comes next and keeps the record (the other ranks take its answers)."""
        self.caches = caches
        self.record = Path(run_dir) / FOLLOW_FILE
        self.token_budget, self.seed, self.world, self.grad_accum = token_budget, seed, world, grad_accum
        self.eval_fraction = eval_fraction
        self.waiter = waiter
        self.parts: list[Part] = []
        self.consumed: list[str] = []
        self.carry: list[int] = []  # train keys of the first epoch not in a batch yet
        self.train_keys: list[int] = []
        self.whole: EpochPlan | None = None
        self.epoch_steps: dict[int, int] = {}  # unknown before the first epoch ends
        self._committed: dict[str, ShardRecord] = {}
        self.replay = self._read_record() if is_first_rank() else []

    def _read_record(self) -> list[str]:
        if not self.record.is_file():
            return []
        try:
            paths = [json.loads(line)["shard"] for line in self.record.read_text().splitlines() if line.strip()]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DFlashCacheError(
                f"{self.record}: unreadable ({e}); it lists the shards this run consumed: restore "
                "it, or start a new run"
            ) from None
        return paths

    def _append_record(self, path: str) -> None:
        if not is_first_rank():
            return
        with open(self.record, "a") as f:
            f.write(json.dumps({"shard": path}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def describe(self, epoch: int = 0) -> list[str]:
        return [
            f"the first epoch follows {self.caches.root} as its extraction commits shards, a shard at a time "
            f"(the order is kept in {self.record.name}); later epochs use the whole cache"
        ]

    def total_steps(self, epochs: int | None, steps: int | None) -> int:
        if steps is None:
            raise DFlashCacheError(
                "--follow needs --steps: the learning-rate schedule needs the run's length, and the "
                "cache's size is not known before its extraction ends"
            )
        return steps

    def segment(self, epoch: int, part: int, rank: int) -> tuple[list[list[int]], int, bool]:
        """This rank's batches of part `part` of `epoch`, the plan position of the part's first batch,
        and whether it is the epoch's last part. Waits for the extraction in the first epoch."""
        if epoch > 0:
            while not (self.parts and self.parts[-1].last):  # a run resumed past the first epoch replays its record
                self._next_part()
            return self._whole().rank_batches(epoch, rank), 0, True
        while part >= len(self.parts):
            self._next_part()
        p = self.parts[part]
        return shard_for_rank(p.batches, rank, self.world), p.offset, p.last

    def _whole(self) -> EpochPlan:
        if self.whole is None:
            self.whole = EpochPlan(
                self.train_keys, self.caches.lengths, self.token_budget, self.seed, self.world, self.grad_accum
            )
        return self.whole

    def _next_part(self) -> None:
        entry = self.waiter.wait(
            f"consumed {len(self.consumed)} shard(s) ({len(self.caches)} samples), waiting for the "
            "next one to be committed",
            self._next_shard,
        )
        offset = self.parts[-1].offset + len(self.parts[-1].batches) if self.parts else 0
        if entry == "":  # the manifest lists nothing more: the left-over samples end the epoch
            self.parts.append(Part(self._last_batches(), offset, True))
            return
        shard = shard_record(entry)
        keys = self.caches.add(shard)
        if shard.path not in self.replay[len(self.consumed) : len(self.consumed) + 1]:
            self._append_record(shard.path)
        self.consumed.append(shard.path)
        train = [k for k in keys if not is_held_out(self.caches.sample_id(k), self.eval_fraction)]
        self.train_keys += train
        pool = self.carry + train
        batches = plan_batches(pool, [self.caches.lengths[k] for k in pool], self.token_budget, self.seed, 0)
        whole = len(batches) // self.step_batches * self.step_batches
        self.carry = [k for b in batches[whole:] for k in b]
        self.parts.append(Part(batches[:whole], offset, False))

    @property
    def step_batches(self) -> int:
        return self.world * self.grad_accum

    def _next_shard(self) -> dict | str | None:
        """The journal entry of the next shard to consume (the record's, when resuming), "" when every shard
        has been, or None (wait)."""
        if len(self.consumed) < len(self.replay):
            path = self.replay[len(self.consumed)]
            if path not in self._committed:  # the journals are read again only for a shard not seen yet
                self._committed = self.caches.committed()
            if path not in self._committed:
                raise DFlashCacheError(
                    f"{self.record} lists {path}, which no journal of {self.caches.root} lists: the cache "
                    "is not the one this run followed; start a new run"
                )
            return self._committed[path].__dict__
        finished = self.caches.finished_shards()  # before the journals: once it exists, they list every shard
        committed = self._committed = self.caches.committed()
        done = set(self.consumed)
        if new := [p for p in committed if p not in done]:
            return committed[min(new, key=_commit_rank)].__dict__
        if finished is None:
            return None
        if finished - done:  # the manifest is built from the journals: a shard it lists is in them
            raise DFlashCacheError(
                f"{self.caches.root}: {MANIFEST} lists shards no journal lists; rerun the same extract "
                "command to rebuild it"
            )
        return ""

    def _last_batches(self) -> list[list[int]]:
        """The left-over samples as whole steps: `step_batches` batches, or more of them when they fill
        more (each batch at most one per sample); none when fewer samples are left than a step has batches."""
        if not self.carry:
            return []
        batches = plan_batches(
            self.carry, [self.caches.lengths[k] for k in self.carry], self.token_budget, self.seed, 0
        )
        if len(batches) % self.step_batches == 0:
            return batches
        count = min(-(-len(batches) // self.step_batches), len(self.carry) // self.step_batches) * self.step_batches
        if count == 0:
            return []
        bins: list[list[int]] = [[] for _ in range(count)]
        tokens = [0] * count
        for key in sorted(self.carry, key=lambda k: (-self.caches.lengths[k], k)):
            i = min(range(count), key=lambda b: (tokens[b], b))  # the least-filled batch takes the next longest
            bins[i].append(key)
            tokens[i] += self.caches.lengths[key]
        return bins

    def global_index(self, local_index: int, rank: int) -> int:
        """The plan position of this rank's `local_index`-th batch of a part, from the part's first."""
        return local_index * self.world + rank


def _commit_rank(path: str) -> tuple[int, str]:
    """Shards of several ranks found at once are taken by shard index, then rank: about the order they were written."""
    name = path.rsplit("/", 1)[-1]
    try:
        index = int(name.rsplit("-", 1)[1].split(".")[0])
    except (IndexError, ValueError):
        index = 0
    return index, path
