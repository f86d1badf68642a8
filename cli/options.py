"""Option types shared by the commands."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable
from pathlib import Path

import click

from dflash_cache.console.options import OPTION, Option


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


def config_options(cls: type) -> Callable:
    """Click options for every field of the dataclass `cls` whose metadata holds an `Option`, in the
    order of the fields; each passes its value under the field's name, ready for `cls(**values)`."""
    hints = typing.get_type_hints(cls)

    def decorate(function: Callable) -> Callable:
        for f in reversed(dataclasses.fields(cls)):
            how = f.metadata.get(OPTION)
            if how is not None:
                flag = how.flag or "--" + f.name.replace("_", "-")
                function = click.option(flag, f.name, **_settings(f, how, flag, hints[f.name]))(function)
        return function

    return decorate


def _settings(f: dataclasses.Field, how: Option, flag: str, hint) -> dict:
    settings: dict = {"help": how.help}
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        settings["required"] = True
    if how.metavar:
        settings["metavar"] = how.metavar
    kind = _kind(hint)
    if kind is bool:
        settings["is_flag"] = True
        if how.invert:
            settings["callback"] = lambda ctx, param, value: not value
        return settings
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        if item is int:
            settings["type"] = INT_LIST
        else:
            settings.update(multiple=True, type=_path(item), callback=lambda ctx, param, value: list(value))
        return settings
    if how.json_object:
        settings["callback"] = lambda ctx, param, value: _json_object(value, flag)
    elif how.unit:
        settings["type"] = float
        settings["callback"] = lambda ctx, param, value: _in_units(value, how, flag)
    elif how.choices:
        settings["type"] = click.Choice(how.choices)
    elif how.minimum is not None:
        settings["type"] = click.IntRange(min=how.minimum)
    elif kind is Path or how.path:
        settings["type"] = _path(kind)
    elif kind in (int, float):
        settings["type"] = kind
    if f.default is not dataclasses.MISSING and f.default is not None:
        default = f.default / how.unit if how.unit else f.default
        settings.update(default=int(default) if how.unit and default.is_integer() else default, show_default=True)
    return settings


def _kind(hint):
    """`X | None` -> X; a union of several types (a path or a URL) -> str."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else str
    return hint


def _path(kind) -> click.Path:
    return click.Path(path_type=Path) if kind is Path else click.Path()


def _in_units(value: float | None, how: Option, flag: str) -> int | None:
    if value is None:
        return None
    if how.positive and value <= 0:
        raise click.BadParameter("must be positive", param_hint=flag)
    return int(value * how.unit)


def _json_object(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not valid JSON ({e.msg} at column {e.colno})", param_hint=flag) from None
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object, e.g. '{\"enable_thinking\": false}'", param_hint=flag)
    return value or None
