"""Integer checks shared by every process: one rule for "a count", naming the bad value; and
the one rounding up to an alignment."""

from __future__ import annotations

import operator

import numpy as np


def require_int(value: object, name: str, *, minimum: int = 0) -> int:
    """Return `value` as an int, or raise naming the offending value.

    bool is refused (it is an int subclass, never a count); numpy integers are
    accepted because routes arrive as numpy arrays.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    number = operator.index(value)
    if number < minimum:
        qualifier = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {qualifier}, got {number}")
    return number


def align_up(value: int, alignment: int) -> int:
    """`value` rounded up to a multiple of `alignment` (block sizes, slot alignment, fio's blocks)."""
    return -(-value // alignment) * alignment


__all__ = ["align_up", "require_int"]
