"""Sizes as every command prints them: decimal units, GB from 1 GB up, MB below."""

from __future__ import annotations


def size(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"
