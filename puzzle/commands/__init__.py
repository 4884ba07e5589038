"""Sub-commands of the `puzzle` command line, one module each (see puzzle/cli.py), and the argument
types they share, so that every number on the command line reads the same way.

Numbers use the budget syntax of puzzle/cost/limits.py: `1000000`, `1e6`, `1M`, `70G`, `2.5B` (= 2.5e9).
A count (tokens, solutions) must come out whole: `1e6` is 1000000, `1.5` is an error.
"""

from __future__ import annotations

import argparse
import math
import re

from puzzle.cost.limits import BudgetError, Relative, parse_value

NUMBER_EXAMPLES = "such as 1000000, 1e6 or 1M"


def parse_number(text: str) -> float:
    """A finite number in the budget syntax (`0.9`, `7e9`, `70G`); argparse.ArgumentTypeError otherwise."""
    try:
        value = parse_value(text)
    except BudgetError:
        raise argparse.ArgumentTypeError(
            f"expected a finite number {NUMBER_EXAMPLES}, found {text!r}"
        ) from None
    if isinstance(value, Relative):
        raise argparse.ArgumentTypeError(
            f"expected an absolute number {NUMBER_EXAMPLES}, found the factor {text!r}"
        )
    return value  # parse_value refuses nan, inf and overflow


def parse_int(text: str) -> int:
    """A whole number in the budget syntax: `'1e6'` and `'1M'` -> 1000000; `'1.5'` is an error."""
    if re.fullmatch(r"\s*[-+]?\d+\s*", text):
        return int(text)  # exact however large, where a float would round
    value = parse_number(text)
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number {NUMBER_EXAMPLES}, found {text!r}")
    return int(value)


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (`'1e6'` -> 1000000)."""
    return _at_least(text, 1, "a positive whole number")


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0 (a seed, a count that may be zero)."""
    return _at_least(text, 0, "a whole number >= 0")


def _at_least(text: str, minimum: int, expected: str) -> int:
    value = parse_int(text)
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, found {text!r}")
    return value


def fraction(text: str) -> float:
    """argparse type: a share in (0, 1] (`'0.9'`)."""
    value = parse_number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] such as 0.9, found {text!r}")
    return value


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """`5GB` -> 5e9 bytes, `500MiB` -> 500 * 2**20, `1024` -> 1024; ValueError naming the text otherwise."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"cannot read size {text!r}: expected a number of bytes like 5GB, 500MB or 2GiB")
    number, unit = float(match.group(1)), match.group(2).upper()
    binary = "I" in unit
    prefix = unit[:1] if unit[:1] in "KMGT" else ""
    scale = 1024 ** "KMGT".index(prefix) * 1024 if binary and prefix else _SIZE_UNITS[prefix]
    if binary and not prefix:
        raise ValueError(f"cannot read size {text!r}: expected a number of bytes like 5GB, 500MB or 2GiB")
    if not math.isfinite(number * scale):
        raise ValueError(f"size {text!r} is not a finite number of bytes")
    size = int(number * scale)
    if size < 1:
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return size


def byte_size(text: str) -> int:
    """`parse_size` as an argparse type (`puzzle convert --max-shard-size`, `puzzle plan --disk`)."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
