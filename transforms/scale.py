"""Scaling by the learning rate and decoupled weight decay."""
from __future__ import annotations

from typing import Callable, NamedTuple

import optree
import torch

from .protocol import GradientTransformation
from .combine import chain, masked
from .context import ShardContext
from .hyperparams import HYPERPARAM_RULES
from .scalars import hyperparam, scalar, zero_count
from .validate import check_number

__all__ = [
    "ScaleByLearningRateState",
    "AddDecayedWeightsState",
    "scale_by_learning_rate",
    "add_decayed_weights",
    "learning_rate",
    "next_learning_rate_state",
    "decoupled",
]


class ScaleByLearningRateState(NamedTuple):
    """``lr``: 0-d float64 (a constant learning rate; see ``set_hyperparams``)."""

    lr: torch.Tensor

    HYPERPARAMS = ("lr",)


class ScaleByScheduleState(NamedTuple):
    """``count``: 0-d int32 applied updates; the learning rate is ``schedule(count)``, not stored
    (``SCHEDULED``): the transform's ``hyperparams`` give it, and so does ``get_hyperparams(state,
    tx)``; ``set_hyperparams`` cannot set it."""

    count: torch.Tensor

    SCHEDULED = ("lr",)


class AddDecayedWeightsState(NamedTuple):
    weight_decay: torch.Tensor

    HYPERPARAMS = ("weight_decay",)


def learning_rate(lr, state) -> torch.Tensor:
    """The 0-d learning rate the next update of ``scale_by_learning_rate(lr)`` applies, from
    its ``state``: ``lr(count)`` for a schedule, else the state's ``lr``."""
    return torch.as_tensor(lr(state.count)) if callable(lr) else state.lr


def next_learning_rate_state(lr, state, count: Callable[[torch.Tensor], torch.Tensor]):
    """``scale_by_learning_rate(lr)``'s state after an update: a schedule's count becomes
    ``count(old count)``; a constant rate's state is unchanged."""
    return ScaleByScheduleState(count(state.count)) if callable(lr) else state


def scale_by_learning_rate(lr) -> GradientTransformation:
    """``u -> -lr * u``. ``lr``: a float (kept as a tensor in the state) or a schedule
    ``count -> lr`` (called with the 0-d int32 count of applied updates, before this one). A float
    ``lr`` must be finite and >= 0, else ``ValueError``; a schedule's values are not checked here
    (they cannot be, before the step), but its ``hyperparams`` give ``{"lr": ...}`` at each step,
    and fzero's engine skips a step whose learning rate is not finite."""
    if callable(lr):
        schedule = lr

        def init(params, *, context: ShardContext | None = None):
            return ScaleByScheduleState(zero_count(params))

        def update(updates, state, params=None, **extra):
            rate = scalar(learning_rate(schedule, state))
            return optree.tree_map(lambda u: (-rate * u).to(u.dtype), updates), ScaleByScheduleState(state.count + 1)

        return GradientTransformation(init, update, None, lambda state: {"lr": learning_rate(schedule, state)})

    check_number("scale_by_learning_rate", "lr", lr, HYPERPARAM_RULES["lr"])

    def init(params, *, context: ShardContext | None = None):
        return ScaleByLearningRateState(hyperparam(lr, params))

    def update(updates, state, params=None, **extra):
        rate = scalar(state.lr)
        return optree.tree_map(lambda u: (-rate * u).to(u.dtype), updates), state

    return GradientTransformation(init, update, None, lambda state: {"lr": state.lr})


def add_decayed_weights(weight_decay: float = 0.0, *, mask=None) -> GradientTransformation:
    """``u -> u + weight_decay * p`` (decoupled decay when followed by ``scale_by_learning_rate``).

    ``mask``: decay only where True: a pytree of bools like the params pytree, or a callable on
    it (see ``masked``). ``weight_decay`` must be finite and >= 0,
    else ``ValueError``."""
    check_number("add_decayed_weights", "weight_decay", weight_decay, HYPERPARAM_RULES["weight_decay"])
    if mask is not None:
        return masked(add_decayed_weights(weight_decay), mask)

    def init(params, *, context: ShardContext | None = None):
        return AddDecayedWeightsState(hyperparam(weight_decay, params))

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("add_decayed_weights needs params")
        wd = scalar(state.weight_decay)
        return optree.tree_map(lambda u, p: (u + wd * p).to(u.dtype), updates, params), state

    return GradientTransformation(init, update)



def decoupled(name: str, direction: GradientTransformation, lr, weight_decay: float, mask,
              *then: GradientTransformation) -> GradientTransformation:
    """The recipe of optax's aliases for an optimizer ``name`` (``"lion"``, ...):
    ``chain(direction, add_decayed_weights(weight_decay, mask=mask), *then,
    scale_by_learning_rate(lr))`` -- decoupled weight decay, scaled by the learning rate as
    torch.optim's is -- with ``lr`` (a float or a schedule) and ``weight_decay`` checked under
    ``name``'s own name (``ValueError``). ``then``: what runs on the decayed direction before the
    learning rate (LAMB's trust ratio)."""
    if not callable(lr):
        check_number(name, "lr", lr, HYPERPARAM_RULES["lr"])
    check_number(name, "weight_decay", weight_decay, HYPERPARAM_RULES["weight_decay"])
    return chain(direction, add_decayed_weights(weight_decay, mask=mask), *then, scale_by_learning_rate(lr))
