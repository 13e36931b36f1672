"""Loss scaling: an immutable state pytree and pure functions around it (like jmp).

A *policy* (``DynamicLossScale``, ``StaticLossScale``, ``NoLossScale``) is static configuration
(Python numbers, fixed for a run). Its ``init()`` returns a ``LossScaleState`` of 0-d tensors
and ``update(state, found_inf)`` returns the next one with tensor ops only (no host sync, no
Python branch on data), so it runs inside a compiled step.

Dynamic rule (Megatron's DynamicGradScaler with torch's GradScaler defaults and a
``[min_scale, max_scale]`` clamp), applied once per step after the cross-rank
``found_inf`` agreement:

* overflow: ``good_steps = 0``; ``hysteresis = max(hysteresis - 1, 0)``; if ``hysteresis == 0``:
  ``scale = max(scale * backoff_factor, min_scale)``. With ``hysteresis=1`` the first overflow
  backs off; with ``hysteresis=h`` the scale survives ``h-1`` overflows, and once the budget is
  spent every further overflow backs off until the next growth refills it.
* clean step: ``good_steps += 1``; once ``good_steps == growth_interval``:
  ``scale = min(scale * growth_factor, max_scale)``, ``good_steps = 0``,
  ``hysteresis = hysteresis`` (refilled). If ``scale * growth_factor`` is not finite in FP32
  (the state's dtype), the scale is kept as it is (as jmp and torch's GradScaler do).

Every scale (``init_scale``, ``min_scale``, ``max_scale``, a static ``scale``) must be finite
and > 0 in FP32, ``growth_factor`` finite and >= 1, ``backoff_factor`` in (0, 1], and
``growth_interval``, ``hysteresis``, ``stuck_after`` integers >= 1 (a bool is neither); otherwise
the policy raises ``ValueError`` naming the field (``transforms.validate``'s checks).

Stuck scale: ``stuck_steps`` counts consecutive overflowing steps taken *at* ``min_scale`` (for a
static scale: at that scale). ``policy.stuck(state)`` is true once it reaches ``stuck_after``:
backing off cannot help any more, the grads are non-finite by themselves (DeepSpeed's endless
"loss scale 1, reducing to 1"). The engine reports it as ``info["scale_stuck"]``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from fzero.transforms.validate import Rule, check_count, check_number

__all__ = [
    "LossScaleState",
    "DynamicLossScale",
    "StaticLossScale",
    "NoLossScale",
    "scale_loss",
]


class LossScaleState(NamedTuple):
    """``scale``: 0-d fp32, the factor the loss is multiplied by.
    ``good_steps``: 0-d int32, consecutive finite steps since the last change.
    ``hysteresis``: 0-d int32, overflows left before the next backoff.
    ``stuck_steps``: 0-d int32, consecutive overflowing steps at the minimum scale."""

    scale: torch.Tensor
    good_steps: torch.Tensor
    hysteresis: torch.Tensor
    stuck_steps: torch.Tensor


def _state(scale: float, hysteresis: int, device) -> LossScaleState:
    int0 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)
    return LossScaleState(torch.tensor(float(scale), dtype=torch.float32, device=device), int0(0), int0(hysteresis), int0(0))


# A scale lives in an FP32 tensor: it must be finite and > 0 once rounded to FP32.
_SCALE: Rule = (lambda v: 0 < v < math.inf, "a finite number > 0 in FP32 (the scale's dtype)")
_GROWTH: Rule = (lambda v: 1.0 <= v < math.inf, "a finite number >= 1")
_BACKOFF: Rule = (lambda v: 0.0 < v <= 1.0, "in (0, 1]")


def _stuck_steps(state: LossScaleState, found_inf: torch.Tensor, min_scale: float) -> torch.Tensor:
    at_min = found_inf & (state.scale <= min_scale)
    return torch.where(at_min, state.stuck_steps + 1, torch.zeros_like(state.stuck_steps))


class _Policy:
    """What every policy shares: the stuck-scale signal (see the module docstring)."""

    stuck_after: int

    def stuck(self, state: LossScaleState) -> torch.Tensor:
        """0-d bool: ``stuck_after`` consecutive overflowing steps at the policy's smallest scale."""
        return state.stuck_steps >= self.stuck_after


@dataclasses.dataclass(frozen=True)
class DynamicLossScale(_Policy):
    """Grow the scale after ``growth_interval`` clean steps, back off on overflow."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    stuck_after: int = 10

    def __post_init__(self):
        name = type(self).__name__
        for field in ("min_scale", "max_scale", "init_scale"):
            check_number(name, field, getattr(self, field), _SCALE, dtype=torch.float32)
        if not self.min_scale <= self.max_scale:
            raise ValueError(f"{name}: min_scale must be <= max_scale, got min_scale={self.min_scale!r} > max_scale={self.max_scale!r}")
        if not self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError(
                f"{name}: init_scale must be in [min_scale, max_scale] = [{self.min_scale!r}, {self.max_scale!r}], got {self.init_scale!r}"
            )
        check_number(name, "growth_factor", self.growth_factor, _GROWTH)
        check_number(name, "backoff_factor", self.backoff_factor, _BACKOFF)
        for field in ("growth_interval", "hysteresis", "stuck_after"):
            check_count(name, field, getattr(self, field), minimum=1)

    def init(self, device=None) -> LossScaleState:
        return _state(self.init_scale, self.hysteresis, device)

    def update(self, state: LossScaleState, found_inf: torch.Tensor) -> LossScaleState:
        scale, good, hyst, _ = state
        hyst_after_inf = (hyst - 1).clamp(min=0)
        backoff = found_inf & (hyst_after_inf <= 0)
        good_next = torch.where(found_inf, torch.zeros_like(good), good + 1)
        grow = good_next >= self.growth_interval
        grown = scale * self.growth_factor
        # An FP32 overflow (inf) keeps the old scale: max_scale may be close to FP32's max.
        grown = torch.where(torch.isfinite(grown), grown, scale).clamp(max=self.max_scale)
        new_scale = torch.where(
            backoff,
            (scale * self.backoff_factor).clamp(min=self.min_scale),
            torch.where(grow, grown, scale),
        )
        new_good = torch.where(grow, torch.zeros_like(good), good_next)
        new_hyst = torch.where(
            found_inf, hyst_after_inf, torch.where(grow, torch.full_like(hyst, self.hysteresis), hyst)
        )
        return LossScaleState(new_scale, new_good, new_hyst, _stuck_steps(state, found_inf, self.min_scale))


@dataclasses.dataclass(frozen=True)
class StaticLossScale(_Policy):
    """A fixed scale; overflowing steps are still skipped, the scale never changes."""

    scale: float
    stuck_after: int = 10

    def __post_init__(self):
        name = type(self).__name__
        check_number(name, "scale", self.scale, _SCALE, dtype=torch.float32)
        check_count(name, "stuck_after", self.stuck_after, minimum=1)

    def init(self, device=None) -> LossScaleState:
        return _state(self.scale, 1, device)

    def update(self, state: LossScaleState, found_inf: torch.Tensor) -> LossScaleState:
        return state._replace(stuck_steps=_stuck_steps(state, found_inf, self.scale))


@dataclasses.dataclass(frozen=True)
class NoLossScale(StaticLossScale):
    """No scaling (scale 1): for BF16/FP32. Non-finite steps are still skipped."""

    scale: float = 1.0


def scale_loss(loss: torch.Tensor, scaler_state: LossScaleState | None) -> torch.Tensor:
    """``loss * scale``, computed in fp32. ``loss`` is returned as is when there is no state."""
    if scaler_state is None:
        return loss
    return loss.float() * scaler_state.scale
