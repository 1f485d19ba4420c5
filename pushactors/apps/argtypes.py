"""Argument types for the command line: a bad number is refused by argparse (exit 2, a clear
message) instead of failing later with a traceback, a division by zero or a loop that never
ends (NaN compares false with everything)."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def positive_int_list(text: str) -> list[int]:
    """A comma list of integers >= 1."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of positive integers")
    return [positive_int(x) for x in items]


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


def positive_seconds(text: str) -> float:
    """A finite duration > 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive number of seconds")
    return value


def nonnegative_seconds(text: str) -> float:
    """A finite duration >= 0."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must not be negative")
    return value


def interval(text: str) -> float:
    """A polling or refresh period: 1 ms to 1 hour (shorter only spins a core)."""
    value = _finite(text)
    if not 0.001 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{value} must be between 0.001 and 3600 seconds")
    return value


def unit_share(text: str) -> float:
    """A share of time, from 0 to 1."""
    value = _finite(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be between 0 and 1")
    return value
