"""The protocol of a gradient transformation, optax style: ``GradientTransformation(init, update)``.

Beside it: ``transforms.combine`` (``chain``, ``masked``), ``transforms.context`` (what a
transform is told about the params it runs on: ``ShardContext``), ``transforms.fused`` (the
in-place form: ``FusedStep``), ``transforms.hyperparams`` (reading and setting a state's
hyperparameters) and ``transforms.tree`` (walking a state).

``init(params, *, context=None) -> state`` and ``update(updates, state, params=None, **extra) ->
(updates, state)`` are pure functions on pytrees (a single tensor is a pytree of one leaf).
``state`` is built from NamedTuples/tuples/dicts of tensors. Hyperparameters live in the state
as 0-d float64 tensors, so changing one (``set_hyperparams``) never retraces a compiled step. A
hyperparameter that follows a schedule (a scheduled ``lr``) is not stored: the state holds the
schedule's count, its NamedTuple class lists the name in ``SCHEDULED``, and the transform's
``hyperparams`` give the value (``get_hyperparams(state, tx)``).

``context``: ``None`` when ``params`` is the params pytree itself (plain use). A caller that
runs the transform on a flat shard of a pytree -- fzero's engine, on one rank's FP32 shard --
passes a ``ShardContext`` instead, so that per-leaf settings (``masked``'s mask, a weight-decay
mask) still refer to the pytree's leaves. Transforms without per-leaf settings ignore it and
``chain``/``masked`` pass it on; ``resolve_per_leaf`` resolves a setting against it.

``extra`` carries what only the caller can know at each step, e.g. ``grad_norm`` (the global
L2 norm of the gradients over all ranks, computed by fzero's engine). Transforms ignore keys
they do not use.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree

from .context import ShardContext

__all__ = ["GradientTransformation", "EmptyState", "identity", "apply_updates"]


class GradientTransformation(NamedTuple):
    """``init(params, *, context=None) -> state``; ``update(updates, state, params=None,
    **extra) -> (updates, state)`` (see the module docstring).

    ``fused`` (optional): the same transformation as an in-place step with one of torch's fused
    kernels, for callers that hold the params as one flat FP32 tensor (fzero's engine, eager):
    ``fused(state, *, grad_scale, found_inf, grad_norm) -> FusedStep`` (``transforms.fused``), or ``None`` when it
    cannot run fused (then use ``update``): it decides before anything is written. ``grad_scale``
    (0-d FP32): the kernel divides the grads by it; ``found_inf`` (0-d bool) makes the step a
    no-op, as in ``update`` + a select. A transform whose kernel updates the params marks its
    function ``updates_params = True``; ``chain`` composes fused forms when only its last member
    does (the others rescale ``grad_scale``).

    ``hyperparams`` (optional): ``state -> {name: 0-d tensor}``, the values the next update
    applies that are not stored as such, e.g. a schedule's learning rate at the state's count
    (``{"lr": schedule(count)}``); ``chain`` and ``masked`` pass their members' on. A caller
    may check them (fzero's engine skips a step whose values are not finite) or report them.

    ``block``: how many consecutive elements of a flat params tensor the state groups together
    (8-bit moments keep one scale per block: ``transforms.quantize.BLOCK``); 1 for an
    elementwise state. A caller running the transform on a flat shard gives it a whole number
    of blocks, and cuts it into chunks only at block edges (fzero's engine aligns every rank's
    slice to it); the state then holds ``[S]`` tensors, ``[S / block]`` per-block tensors and
    0-d ones. ``chain`` takes the least common multiple of its members'.

    ``needs_context``: the update is not elementwise on a flat tensor standing for the params
    (it groups leaves, or needs each leaf whole): a caller that runs it on such a tensor passes
    the ``ShardContext`` it gave ``init`` to every ``update`` as ``context=``, and never cuts
    the tensor into chunks. ``chain`` and ``masked`` need it when a member does."""

    init: Callable[..., Any]
    update: Callable[..., tuple[Any, Any]]
    fused: Callable[..., Any] | None = None
    hyperparams: Callable[[Any], dict] | None = None
    block: int = 1
    needs_context: bool = False


class EmptyState(NamedTuple):
    pass


def identity() -> GradientTransformation:
    """Leaves updates unchanged."""

    def init(params, *, context: ShardContext | None = None):
        return EmptyState()

    def update(updates, state, params=None, **extra):
        return updates, state

    return GradientTransformation(init, update)


def apply_updates(params, updates):
    """``params + updates``, leaf by leaf, in each param's dtype."""
    return optree.tree_map(lambda p, u: (p + u).to(p.dtype), params, updates)
