"""Transforms made of transforms: ``chain`` (one after another) and ``masked`` (on some leaves)."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from .protocol import GradientTransformation
from .context import ShardContext, resolve_per_leaf
from .fused import FusedStep, updates_params

__all__ = ["chain", "masked", "MaskedState"]


def chain(*txs: GradientTransformation) -> GradientTransformation:
    """Apply ``txs`` in order; the state is a tuple of their states. ``init`` gives each the
    same ``context``."""

    def init(params, *, context: ShardContext | None = None):
        return tuple(tx.init(params, context=context) for tx in txs)

    def update(updates, state, params=None, **extra):
        new_state = []
        for tx, s in zip(txs, state):
            updates, s = tx.update(updates, s, params, **extra)
            new_state.append(s)
        return updates, tuple(new_state)

    def fused(state, *, grad_scale, found_inf, grad_norm):
        new_state, kernel, adamw, at = [], None, None, 0
        for i, (tx, s) in enumerate(zip(txs, state)):
            out = tx.fused(s, grad_scale=grad_scale, found_inf=found_inf, grad_norm=grad_norm)
            if out is None:  # declined: nothing has been written yet
                return None
            new_state.append(out.state)
            grad_scale, kernel, adamw, at = out.grad_scale, out.kernel, out.adamw, i
        last = kernel and (lambda params, grads, s: kernel(params, grads, s[at]))
        return FusedStep(last, tuple(new_state), grad_scale, adamw)

    def hyperparams(state):
        return {k: v for tx, s in zip(txs, state) if tx.hyperparams for k, v in tx.hyperparams(s).items()}

    hyper = hyperparams if any(tx.hyperparams for tx in txs) else None
    block = math.lcm(*(tx.block for tx in txs)) if txs else 1
    # A member that updates the params must be the last one: a member after it would transform
    # updates that its kernel never produces.
    every_fused = bool(txs) and all(tx.fused is not None for tx in txs)
    needs = any(tx.needs_context for tx in txs)
    if every_fused and not any(updates_params(tx.fused) for tx in txs[:-1]):
        fused.updates_params = updates_params(txs[-1].fused)
        return GradientTransformation(init, update, fused, hyper, block, needs)
    return GradientTransformation(init, update, None, hyper, block, needs)


class MaskedState(NamedTuple):
    """``inner``: the wrapped transform's state. ``mask``: the mask as ``resolve_per_leaf``
    gives it: a pytree of bools like the params (plain use) or, with a ``ShardContext``, a bool
    tensor laid out like the params (under fzero's engine the ``[S]`` shard, 1 byte/element)."""

    inner: Any
    mask: Any


def masked(inner: GradientTransformation, mask) -> GradientTransformation:
    """Apply ``inner`` only where ``mask`` is True; elsewhere updates pass through unchanged.

    ``mask``: a pytree of bools (or bool tensors broadcastable to each leaf) with the params'
    structure, or a callable ``params -> such a pytree``, e.g. ``lambda p: tree_map(lambda x:
    x.ndim > 1, p)`` for "no weight decay on biases and norm gains". It always refers to the
    params *pytree*: ``init(params, *, context=None)`` resolves it once with
    ``resolve_per_leaf`` (with a ``ShardContext``, against ``context.tree``, laid out by
    ``context.to_shard``) and passes ``context`` on to ``inner``.
    """

    def init(params, *, context: ShardContext | None = None):
        return MaskedState(inner.init(params, context=context), resolve_per_leaf(mask, params, context))

    def update(updates, state, params=None, **extra):
        new, inner_state = inner.update(updates, state.inner, params, **extra)

        def pick(m, n, u):
            return torch.where(m, n, u) if isinstance(m, torch.Tensor) else (n if m else u)

        if isinstance(state.mask, torch.Tensor):
            chosen = optree.tree_map(lambda n, u: pick(state.mask, n, u), new, updates)
        else:
            chosen = optree.tree_map(pick, state.mask, new, updates)
        return chosen, MaskedState(inner_state, state.mask)

    hyperparams = inner.hyperparams and (lambda state: inner.hyperparams(state.inner))
    return GradientTransformation(init, update, None, hyperparams, inner.block, inner.needs_context)
