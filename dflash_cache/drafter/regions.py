"""Regional compilation: the eager drafter's hot parts compiled once for every batch shape.

Eager mode runs on batches whose token and anchor counts change every step, with no padding. On a GPU
its decoder layers (norms, projections, rotary, flex-attention, SwiGLU), the context projection and
the LM-head loss's per-chunk math each run as one region compiled for dynamic shapes: the region's
elementwise chains fuse into a few kernels, and one graph per region serves every shape. What is left
between the regions (the embedding, rotary tables, the mask build, the final norm) is a few kernels.

A region is compiled
  - without duck shaping: two sizes that happen to be equal in the first batch (a query count that is
    a whole number of tiles and a mask's padded length) would otherwise become one symbol, and the
    next batch where they differ would compile again (seen at step 212 of 500 on an H200);
  - without Inductor's mix-order reduction, whose size checks (rows x features >= 5 x 2^20, rows >=
    2 x features) add guards on the row count, so that a later batch on the other side of 10,240
    context tokens compiled a norm again (seen at step 41 of 200 on an H200, torch 2.11).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Options for Inductor only: other backends (aot_eager in the CPU tests) take none.
INDUCTOR_OPTIONS = {"triton.mix_order_reduction": False}


def region(fn: Callable, backend: str | Callable = "inductor") -> Callable:
    """`fn` compiled for dynamic shapes, as a region of the eager drafter."""
    options = INDUCTOR_OPTIONS if backend == "inductor" else None
    compiled = torch.compile(fn, dynamic=True, backend=backend, options=options)

    def call(*args, **kwargs):
        if torch.compiler.is_compiling():  # inside a whole-drafter graph: traced as part of it
            return fn(*args, **kwargs)
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return call
