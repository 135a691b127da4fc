"""Argument types the command line shares: argparse refuses a value that breaks them in its one line."""
from __future__ import annotations

import argparse

__all__ = ["at_least"]


def at_least(minimum: int):
    """An argparse type: an integer >= ``minimum`` (a count, a size, a number of threads)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value '{text}'") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not allowed; give an integer >= {minimum}")
        return value
    return parse
