"""Argument types of ``python -m gdn_kcp``: argparse calls them while it parses,
so a bad value stops the command (``error: argument --ranks: ...``, exit 2)
before it prints anything."""

from __future__ import annotations

import argparse


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An int >= 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def int_in(low: int, high: int):
    """An int in ``[low, high]``."""

    def parse(text: str) -> int:
        value = _integer(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}, got {value}")
        return value

    parse.__name__ = f"int in [{low}, {high}]"
    return parse


def length_list(text: str) -> list[int]:
    """Comma-separated non-negative ints (token counts), e.g. ``300,0,700``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"must list at least one length, got {text!r}")
    negative = [x for x in values if x < 0]
    if negative:
        raise argparse.ArgumentTypeError(f"lengths must not be negative, got {negative[0]} in {text!r}")
    return values
