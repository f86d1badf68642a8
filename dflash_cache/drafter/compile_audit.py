"""Counting what torch.compile compiles during training, and batch shapes that never repeat.

`CompileCounts.now()` reads torch._dynamo's process-wide counters; the difference of two readings is
what compiled in between: frames compiled by dynamo (a recompilation is a frame compiled again after
a guard failed), graphs handed to a backend, the failed guards that caused recompilations, with
their text (as TORCH_LOGS=recompiles prints them), and frames dynamo gave up on. Past its recompile
limit a frame runs eagerly and is never looked at again, so a shape-specialized model compiles
nothing after its first few shapes and only that last count shows it. A backward graph is compiled
when its forward graph first runs backward, so a step that compiles no forward frame compiles no
backward either.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass
class CompileCounts:
    frames: int = 0  # frames dynamo compiled (first compilations and recompilations)
    left_to_eager: int = 0  # frames dynamo tried and did not compile (e.g. past its recompile limit)
    graphs: int = 0  # graphs handed to a backend
    failures: dict = field(default_factory=dict)  # code object -> texts of its failed guards, oldest first

    @classmethod
    def now(cls) -> CompileCounts:
        from torch._dynamo.utils import counters, guard_failures

        ok = counters["frames"]["ok"]
        return cls(
            ok,
            counters["frames"]["total"] - ok,
            counters["stats"]["unique_graphs"],
            {code: list(reasons) for code, reasons in guard_failures.items()},
        )

    def __sub__(self, earlier: CompileCounts) -> CompileCounts:
        failures = {code: reasons[len(earlier.failures.get(code, ())) :] for code, reasons in self.failures.items()}
        return CompileCounts(
            self.frames - earlier.frames,
            self.left_to_eager - earlier.left_to_eager,
            self.graphs - earlier.graphs,
            {code: reasons for code, reasons in failures.items() if reasons},
        )

    @property
    def reasons(self) -> list[str]:
        """The failed guards that led to recompilations (TORCH_LOGS=recompiles prints the same)."""
        return [f"{code.co_name}: {reason}" for code, reasons in self.failures.items() for reason in reasons]

    @property
    def compiled_anything(self) -> bool:
        return self.frames > 0 or self.left_to_eager > 0 or self.graphs > 0 or bool(self.reasons)

    def to_dict(self, max_reasons: int = 5) -> dict:
        return {
            "frames": self.frames,
            "left_to_eager": self.left_to_eager,
            "graphs": self.graphs,
            "recompile_reasons": len(self.reasons),
            "first_reasons": self.reasons[:max_reasons],
        }


def distinct_length_plans(
    steps: int, token_budget: int, seed: int = 0, median: float = 0.0, sigma: float = 1.0, min_length: int = 8
) -> list[list[int]]:
    """`steps` packed batches of sample lengths, no two alike in (number of samples, lengths) nor,
    where the budget allows, in total tokens: lognormal lengths around `median` (default an eighth of
    the budget) packed greedily up to a budget that itself varies between half and all of
    `token_budget`, as a shuffled token-budget plan would hand them out."""
    rng = random.Random(seed)
    median = median or token_budget / 8
    plans: list[list[int]] = []
    seen_plans: set[tuple[int, ...]] = set()
    seen_totals: set[int] = set()
    attempts = 0
    while len(plans) < steps:
        attempts += 1
        if attempts > 100 * steps + 1000:
            raise ValueError(f"cannot draw {steps} distinct batches within {token_budget} tokens; raise the budget")
        budget = rng.randint(max(min_length, token_budget // 2), token_budget)
        lengths: list[int] = []
        while True:
            n = max(min_length, min(token_budget, round(math.exp(rng.gauss(math.log(median), sigma)))))
            if sum(lengths) + n > budget:
                break
            lengths.append(n)
        if not lengths:
            continue
        key, total = tuple(lengths), sum(lengths)
        # totals are kept distinct while there are enough of them to go round
        if key in seen_plans or (total in seen_totals and len(seen_totals) < token_budget // 4):
            continue
        seen_plans.add(key)
        seen_totals.add(total)
        plans.append(lengths)
    return plans
