"""Each command-line option written once: a config dataclass field holds its default, and its
metadata (`option(...)`) the help and how the command line spells it. cli/options.py builds the
commands' click options from these fields; nothing here imports click or torch."""

from __future__ import annotations

from dataclasses import dataclass

OPTION = "option"  # the key of a field's metadata that makes it a command-line option


@dataclass(frozen=True)
class Option:
    help: str
    flag: str | None = None  # the command line's name; None: --field-name
    choices: tuple[str, ...] | None = None
    unit: int | None = None  # the command line gives the value in units of this many (MiB: 1 << 20), as a float
    positive: bool = False  # with `unit`: the command line refuses 0 and less itself
    invert: bool = False  # a flag whose presence sets the field to False
    minimum: int | None = None  # an int the command line refuses below this
    path: bool = False  # a file or folder name kept as a string
    json_object: bool = False  # a JSON object, parsed by the command line
    metavar: str | None = None


def option(help: str, **how) -> dict:
    """A field's metadata: `field(default=..., metadata=option("Help.", flag="--name"))`."""
    return {OPTION: Option(help, **how)}
