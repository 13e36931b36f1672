"""The hyperparameters a transform state stores, by name: read them (``iter_hyperparams``,
``get_hyperparams``), change them between steps (``set_hyperparams``), the valid range of the
built-in ones (``HYPERPARAM_RULES``), and the caller's states that hold a transform state
(``register_holder``).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .protocol import GradientTransformation
from .scalars import with_host_value
from .tree import named_tuples
from .validate import Rule, check_number

__all__ = ["HYPERPARAM_RULES", "iter_hyperparams", "get_hyperparams", "set_hyperparams", "register_holder"]


def _finite_at_least_0(v: float) -> bool:
    return math.isfinite(v) and v >= 0


# The valid range of each hyperparameter the built-in transforms keep in their states (the same
# ranges torch.optim checks, and finite), as ``transforms.validate`` rules: factories check their
# arguments against it, and ``set_hyperparams`` checks new values of these names.
HYPERPARAM_RULES: dict[str, Rule] = {
    "lr": (_finite_at_least_0, "a finite number >= 0"),
    "b1": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    "b2": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    "b3": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    "alpha": (_finite_at_least_0, "a finite number >= 0"),
    "weight_lr_power": (_finite_at_least_0, "a finite number >= 0"),
    "beta2_decay": (lambda v: math.isfinite(v) and v <= 0, "a finite number <= 0"),
    "eps1": (_finite_at_least_0, "a finite number >= 0"),
    "eps2": (_finite_at_least_0, "a finite number >= 0"),
    "d": (lambda v: math.isfinite(v) and v >= 1, "a finite number >= 1"),
    "eps": (_finite_at_least_0, "a finite number >= 0"),
    "weight_decay": (_finite_at_least_0, "a finite number >= 0"),
    "momentum": (_finite_at_least_0, "a finite number >= 0"),
    "max_norm": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
}


# A caller's state class whose instances hold a transform's state beside state of the caller's
# own (fzero's ZeroState: the master shard and the transform state) -> the function that hands
# out the transform state (``register_holder``).
_HOLDERS: dict[type, Callable[[Any, str], Any]] = {}


def register_holder(cls: type, transform_state: Callable[[Any, str], Any]) -> None:
    """Have ``get_hyperparams``, ``iter_hyperparams`` and ``set_hyperparams`` take an instance of
    ``cls``, a caller's state that holds a transform's state (fzero registers its ``ZeroState``):
    ``transform_state(holder, where)`` returns that transform state, or raises naming ``where``
    (the function called) if the holder may not be read any more (fzero: a state that a
    donating step consumed)."""
    _HOLDERS[cls] = transform_state


def _transform_state(state, where: str):
    """The transform state ``state`` is or holds (``register_holder``)."""
    read = _HOLDERS.get(type(state))
    return state if read is None else read(state, where)


def iter_hyperparams(state):
    """Yield ``(name, tensor)`` for every stored hyperparameter of ``state`` -- a 0-d tensor field
    named in a state NamedTuple's ``HYPERPARAMS`` -- depth first, one pair per field (two
    transforms with an ``lr`` give two pairs): the optimizer's configuration that checkpoints
    keep and ``set_hyperparams`` changes. A scheduled value is none of them (see
    ``get_hyperparams``). ``state``: a transform's state, or a holder of one (fzero's engine
    state, see ``register_holder``)."""
    for node in named_tuples(_transform_state(state, "iter_hyperparams")):
        for name in getattr(type(node), "HYPERPARAMS", ()):
            yield name, getattr(node, name)


def get_hyperparams(state, tx: GradientTransformation | None = None) -> dict[str, torch.Tensor]:
    """Every hyperparameter by name (depth first, the last of equal names wins): the stored ones
    (``iter_hyperparams``) and, given the transform ``tx`` that built ``state``, the values its
    ``hyperparams`` compute from the state, such as a scheduled ``lr``: ``schedule(count)`` at
    the state's count of applied updates, the value the next update applies and fzero's engine
    reports as that step's ``info["lr"]`` (like torch's ``scheduler.get_last_lr()``). 0-d
    tensors, computed with tensor ops: no host sync. ``state``: the transform's state, or a
    holder of one (``register_holder``): fzero's engine state as ``init`` and ``step`` return it,
    or its ``tx_state``."""
    state = _transform_state(state, "get_hyperparams")
    out = dict(iter_hyperparams(state))
    if tx is not None and tx.hyperparams is not None:
        out.update(tx.hyperparams(state))
    return out


def set_hyperparams(state, **values):
    """A copy of ``state`` with the named hyperparameters replaced (e.g. ``lr=3e-4``).

    Values become 0-d tensors (dtype of the old value) on the old value's device; the state's structure is
    unchanged, so a compiled step keeps its graph. Only stored hyperparameters can be set
    (``iter_hyperparams``): a name that follows a schedule in ``state`` (a scheduled ``lr``) raises
    ``ValueError`` saying so; other unknown names raise ``KeyError`` naming the ones
    there are. New values of
    the built-in names are checked like the factories' arguments (``lr``, ``eps``,
    ``weight_decay``, ``momentum``, ``alpha``, ``weight_lr_power``, ``eps1``, ``eps2`` finite and
    >= 0; ``b1``, ``b2``, ``b3`` in [0, 1); ``max_norm`` finite and > 0; ``beta2_decay`` finite
    and <= 0; ``d`` finite and >= 1; a state class may narrow a range in its ``RULES``, as
    ``ScheduleFreeState`` does ``b1`` to (0, 1)), Python numbers and tensors alike (a tensor is
    read on the host: call this between steps, not inside one); a value out of range raises
    ``ValueError`` and changes nothing.
    ``state``: a transform's state, or a holder of one (``register_holder``: fzero's engine
    state), returned with the same structure.
    """
    _transform_state(state, "set_hyperparams")  # a holder that may not be read raises
    for node in named_tuples(state):
        for name in sorted(set(values) & set(getattr(type(node), "SCHEDULED", ()))):
            raise ValueError(f"set_hyperparams: {name} follows a schedule (the state stores its count only, in "
                             f"{type(node).__name__}), which set_hyperparams cannot change: build the transform with a "
                             f"new schedule, or with a constant {name} to set it between steps")
    stored = {name for name, _ in iter_hyperparams(state)}
    unknown = set(values) - stored
    if unknown:
        raise KeyError(f"no hyperparameter(s) {sorted(unknown)} in state; have {sorted(stored)}")
    for node in named_tuples(state):  # first a state class's narrower range of a name (its ``RULES``)
        for name, rule in getattr(type(node), "RULES", {}).items():
            if name in values:
                check_number(f"set_hyperparams ({type(node).__name__})", name, values[name], rule)
    checked = {}
    for name, value in values.items():
        checked[name] = check_number("set_hyperparams", name, value, HYPERPARAM_RULES[name]) if name in HYPERPARAM_RULES else float(value)

    def rebuild(node):
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            fields = {f: rebuild(getattr(node, f)) for f in node._fields}
            for name in getattr(type(node), "HYPERPARAMS", ()):
                if name in values:
                    old = fields[name]
                    new = torch.as_tensor(values[name], dtype=old.dtype, device=old.device).reshape(())
                    fields[name] = with_host_value(new.clone() if new is values[name] else new, checked[name])
            return type(node)(**fields)
        if isinstance(node, (tuple, list)):
            return type(node)(rebuild(c) for c in node)
        if isinstance(node, dict):
            return {k: rebuild(v) for k, v in node.items()}
        return node

    return rebuild(state)
