"""LAMB: Adam's direction with decoupled weight decay, each leaf's step scaled by the trust ratio
``||p|| / ||u||`` (optax's ``lamb``).

You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes" (arXiv
1904.00962), Algorithm 2; the arrangement and the defaults of ``optax.lamb`` and
``optax.scale_by_trust_ratio`` (optax ``_src/alias.py`` and ``_src/transform.py``), with
torch-style argument names as ``adamw`` has.
"""
from __future__ import annotations

import optree
import torch

from .protocol import EmptyState, GradientTransformation
from .adam import scale_by_adam
from .context import ShardContext
from .hyperparams import HYPERPARAM_RULES
from .scale import decoupled
from .validate import check_number

__all__ = ["scale_by_trust_ratio", "lamb"]


def _trust_ratio(p_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
    """``||p|| / ||u||``, and 1 where either norm is 0 (a leaf at zero, or no update: optax's
    rule, so such a leaf still takes its step)."""
    return torch.where((p_norm == 0) | (u_norm == 0), torch.ones_like(p_norm), p_norm / u_norm)


def scale_by_trust_ratio() -> GradientTransformation:
    r"""Each leaf's updates times the trust ratio of the leaf:

    .. math:: u \leftarrow u \cdot \frac{\lVert p \rVert_2}{\lVert u \rVert_2}

    (1 where either norm is 0), the norms of the whole leaf in FP32 (``optax.scale_by_trust_ratio()``
    with its defaults: no minimum norm, no coefficient, no eps). Not elementwise: on a flat
    shard standing for the params (fzero's engine) the norms are summed over every rank that
    holds a part of the leaf (``ShardContext.leaf_norms``: one all-reduce of two FP32 values per
    leaf per step). Stateless; needs ``params``."""

    def init(params, *, context: ShardContext | None = None):
        return EmptyState()

    def update(updates, state, params=None, *, context: ShardContext | None = None, **extra):
        if params is None:
            raise ValueError("scale_by_trust_ratio needs params (the norm of each leaf)")
        if context is None:  # the leaves are the params' own
            def leaf(u, p):
                return (u.float() * _trust_ratio(p.float().norm(), u.float().norm())).to(u.dtype)

            return optree.tree_map(leaf, updates, params), state
        p_norm, u_norm = context.leaf_norms(params, updates)
        return (updates.float() * _trust_ratio(p_norm, u_norm)).to(updates.dtype), state

    return GradientTransformation(init, update, needs_context=True)


def lamb(lr=1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0, *,
         weight_decay_mask=None) -> GradientTransformation:
    r"""LAMB, ``optax.lamb``'s chain: ``scale_by_adam(b1, b2, eps)``, then
    ``add_decayed_weights(weight_decay, mask=weight_decay_mask)``, then ``scale_by_trust_ratio()``,
    then ``scale_by_learning_rate(lr)``:

    .. math:: r = \frac{\hat m}{\sqrt{\hat v} + \epsilon} + \lambda p,\qquad
              p \leftarrow p - \mathrm{lr}\,\frac{\lVert p \rVert}{\lVert r \rVert}\, r \quad\text{(per leaf)}

    ``lr``: a float or a schedule ``count -> lr``. ``weight_decay_mask``: the leaves that decay,
    as in ``adamw`` (optax's default ``weight_decay`` is 1e-4, torch-style 0 here). Adam's
    moments are FP32, 8 bytes per param, as AdamW's. Invalid values raise ``ValueError`` here."""
    if len(betas) != 2:
        raise ValueError(f"lamb: betas must be (b1, b2), got {betas!r}")
    for name, value in (("betas[0]", betas[0]), ("betas[1]", betas[1])):
        check_number("lamb", name, value, HYPERPARAM_RULES["b1"])
    check_number("lamb", "eps", eps, HYPERPARAM_RULES["eps"])
    return decoupled("lamb", scale_by_adam(betas[0], betas[1], eps), lr, weight_decay, weight_decay_mask,
                     scale_by_trust_ratio())
