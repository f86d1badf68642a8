"""Option types shared by the commands."""

from __future__ import annotations

import click


class IntList(click.ParamType):
    """'1,16,31' or '0-4' or '0-2,5'."""

    name = "list"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        out: list[int] = []
        try:
            for part in filter(None, (p.strip() for p in str(value).split(","))):
                lo, sep, hi = part.partition("-")
                out += list(range(int(lo), int(hi) + 1)) if sep else [int(part)]
        except ValueError:
            self.fail(f"{value!r} is not a list of integers like 1,16,31 or 0-4", param, ctx)
        return out


INT_LIST = IntList()

LAYER_RULE = (
    "Capture N target layers: the middle one (num_layers // 2) for N=1; else N spread evenly over "
    "layers 1..num_layers-3 (the reference DFlash rule), or over all layers 0..num_layers-1 when the "
    "target has fewer than N+3 layers. Default when --layers is not given: 5, or every layer of a "
    "target with fewer than 5."
)
