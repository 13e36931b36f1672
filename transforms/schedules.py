"""Learning-rate schedules: plain ``count -> value`` functions (optax semantics, stricter arguments).

``count`` is the number of *applied* updates so far (a 0-d int tensor inside a step; a Python
int works too, e.g. for plotting). Values are computed with tensor ops only (no Python
branch on ``count``), as 0-d float64 tensors, so a compiled step never retraces as ``count``
grows.

Arguments are checked when the schedule is built (``transforms.validate``): values must be finite
numbers, step counts integers (a Python int or anything with ``__index__``, not a bool) and not
negative, else ``ValueError`` naming the argument. A zero-length transition holds ``init_value``
forever, as in optax; unlike optax, a negative step count is an error rather than a zero-length
transition.
"""
from __future__ import annotations

import math

import torch

from .validate import check_count, check_number

__all__ = ["constant", "linear", "linear_warmup", "cosine_decay", "warmup_cosine_decay"]


def _t(count) -> torch.Tensor:
    return torch.as_tensor(count).to(torch.float64)


def constant(value: float):
    """``value`` at every step."""
    value = check_number("constant", "value", value)
    return lambda count: torch.full_like(_t(count), value)


def _linear(init_value: float, end_value: float, steps: int):
    if steps == 0:  # optax: a zero-length transition holds init_value
        return lambda count: torch.full_like(_t(count), init_value)

    def schedule(count):
        frac = _t(count).clamp(0, steps) / steps
        return init_value + (end_value - init_value) * frac

    return schedule


def linear(init_value: float, end_value: float, transition_steps: int):
    """``init + (end - init) * min(count, T) / T``; ``end_value`` from step ``T`` on.
    ``transition_steps == 0``: ``init_value`` at every step (optax's rule)."""
    return _linear(
        check_number("linear", "init_value", init_value),
        check_number("linear", "end_value", end_value),
        check_count("linear", "transition_steps", transition_steps, minimum=0),
    )


def linear_warmup(init_value: float, peak_value: float, warmup_steps: int):
    """Linear from ``init_value`` to ``peak_value`` over ``warmup_steps``, then ``peak_value``.
    ``warmup_steps == 0``: ``init_value`` at every step (optax's ``linear_schedule``)."""
    return _linear(
        check_number("linear_warmup", "init_value", init_value),
        check_number("linear_warmup", "peak_value", peak_value),
        check_count("linear_warmup", "warmup_steps", warmup_steps, minimum=0),
    )


def _cosine(init_value: float, steps: int, end_value: float):
    def schedule(count):
        frac = _t(count).clamp(0, steps) / steps
        return end_value + (init_value - end_value) * 0.5 * (1 + torch.cos(math.pi * frac))

    return schedule


def cosine_decay(init_value: float, decay_steps: int, end_value: float = 0.0):
    """``end + (init - end) * (1 + cos(pi * min(count, D) / D)) / 2``; ``end_value`` after ``D``."""
    return _cosine(
        check_number("cosine_decay", "init_value", init_value),
        check_count("cosine_decay", "decay_steps", decay_steps, minimum=1),
        check_number("cosine_decay", "end_value", end_value),
    )


def warmup_cosine_decay(init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0):
    """Linear warmup ``init -> peak`` over ``warmup_steps``, then cosine ``peak -> end`` until
    step ``decay_steps`` (which *includes* the warmup, as in optax), then ``end_value``.
    ``warmup_steps == 0``: the cosine starts at ``peak_value`` on step 0 (``init_value`` unused)."""
    where = "warmup_cosine_decay"
    init_value, peak_value = check_number(where, "init_value", init_value), check_number(where, "peak_value", peak_value)
    end_value = check_number(where, "end_value", end_value)
    warmup_steps = check_count(where, "warmup_steps", warmup_steps, minimum=0)
    decay_steps = check_count(where, "decay_steps", decay_steps, minimum=1)
    if decay_steps <= warmup_steps:
        raise ValueError(f"{where}: decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps})")
    warm = _linear(init_value, peak_value, warmup_steps)
    decay = _cosine(peak_value, decay_steps - warmup_steps, end_value)

    def schedule(count):
        t = _t(count)
        return torch.where(t < warmup_steps, warm(t), decay(t - warmup_steps))

    return schedule
