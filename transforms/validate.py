"""Construction-time checks of numeric arguments: hyperparameters, schedule values, loss scales,
step counts. One rule for all of them, so that a bad value gets the same kind of error everywhere.

A number is a Python real number or a one-element tensor, read on the host (call these when
building a transform, schedule or policy, never inside a step); a bool, or a bool tensor, is
refused (``lr=True`` is not 1.0), and so is a string (``"1e-3"`` is text, not a number). Every
error is a ``ValueError`` of one form, ``"{where}: {name} must be {need}, got {value!r}"``: the
function or class checking, the argument, what it must be, and what it was.
"""
from __future__ import annotations

import math
import operator
from typing import Callable

import torch

__all__ = ["Rule", "FINITE", "check_number", "check_count"]

Rule = tuple[Callable[[float], bool], str]
"""``(ok, need)``: ``ok(v)`` says whether the float ``v`` is valid; ``need`` says what a valid
value is, completing "must be ..." (e.g. ``"a finite number >= 0"``)."""

FINITE: Rule = (math.isfinite, "a finite number")


def _is_bool(value) -> bool:
    return isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)


def check_number(where: str, name: str, value, rule: Rule = FINITE, *, dtype: torch.dtype | None = None) -> float:
    """``value`` as a float, or ``ValueError`` naming ``where``, ``name``, what ``rule`` needs and
    the value. ``dtype``: the value is stored in a tensor of that dtype, so ``rule`` judges it
    rounded to that dtype (``1e39`` is inf in FP32, ``1e-50`` is 0); the float returned is the
    value as given."""
    if _is_bool(value):
        raise ValueError(f"{where}: {name} must be a real number or a 1-element tensor, not a bool, got {value!r}")
    try:
        if isinstance(value, (str, bytes)):  # float() would parse the text
            raise TypeError
        v = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{where}: {name} must be a real number or a 1-element tensor, got {value!r}") from None
    seen = torch.tensor(v, dtype=dtype).item() if dtype is not None and math.isfinite(v) else v
    ok, need = rule
    if not ok(seen):
        raise ValueError(f"{where}: {name} must be {need}, got {v if isinstance(value, torch.Tensor) else value!r}")
    return v


def check_count(where: str, name: str, value, *, minimum: int) -> int:
    """``value`` as an int, or ``ValueError`` if it is not an integer >= ``minimum``. An integer
    is a Python int or anything with ``__index__`` (a 1-element integer tensor), not a bool; a
    float, even ``2.0``, is refused."""
    try:
        n = None if _is_bool(value) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < minimum:
        raise ValueError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return n
