"""Learning-rate schedules: plain ``count -> value`` functions (optax semantics).

``count`` is the number of *applied* updates so far (a 0-d int tensor inside a step; a Python
int works too, e.g. for plotting). Values are computed with tensor ops only (no Python
branch on ``count``), as 0-d float64 tensors, so a compiled step never retraces as ``count``
grows.
"""
from __future__ import annotations

import math

import torch

__all__ = ["constant", "linear", "linear_warmup", "cosine_decay", "warmup_cosine_decay"]


def _t(count) -> torch.Tensor:
    return torch.as_tensor(count).to(torch.float64)


def constant(value: float):
    """``value`` at every step."""
    return lambda count: torch.full_like(_t(count), float(value))


def linear(init_value: float, end_value: float, transition_steps: int):
    """``init + (end - init) * min(count, T) / T``; ``end_value`` from step ``T`` on."""
    if transition_steps <= 0:
        return constant(end_value)

    def schedule(count):
        frac = _t(count).clamp(0, transition_steps) / transition_steps
        return init_value + (end_value - init_value) * frac

    return schedule


def linear_warmup(init_value: float, peak_value: float, warmup_steps: int):
    """Linear from ``init_value`` to ``peak_value`` over ``warmup_steps``, then ``peak_value``."""
    return linear(init_value, peak_value, warmup_steps)


def cosine_decay(init_value: float, decay_steps: int, end_value: float = 0.0):
    """``end + (init - end) * (1 + cos(pi * min(count, D) / D)) / 2``; ``end_value`` after ``D``."""
    if decay_steps <= 0:
        raise ValueError(f"cosine_decay needs decay_steps > 0, got {decay_steps}")

    def schedule(count):
        frac = _t(count).clamp(0, decay_steps) / decay_steps
        return end_value + (init_value - end_value) * 0.5 * (1 + torch.cos(math.pi * frac))

    return schedule


def warmup_cosine_decay(init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0):
    """Linear warmup ``init -> peak`` over ``warmup_steps``, then cosine ``peak -> end`` until
    step ``decay_steps`` (which *includes* the warmup, as in optax), then ``end_value``."""
    if decay_steps <= warmup_steps:
        raise ValueError(f"decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps})")
    warm = linear(init_value, peak_value, warmup_steps)
    decay = cosine_decay(peak_value, decay_steps - warmup_steps, end_value)

    def schedule(count):
        t = _t(count)
        return torch.where(t < warmup_steps, warm(t), decay(t - warmup_steps))

    return schedule
