"""Lion: the sign of an interpolation of the momentum and the gradient (optax's ``lion``).

Chen et al., "Symbolic Discovery of Optimization Algorithms" (arXiv 2302.06675), Algorithm 2;
the arrangement and the defaults of ``optax.scale_by_lion`` and ``optax.lion`` (optax
``_src/transform.py`` and ``_src/alias.py``), with torch-style argument names as ``adamw`` has.
"""
from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from .protocol import GradientTransformation
from .context import ShardContext
from .hyperparams import HYPERPARAM_RULES
from .scalars import hyperparam, scalar, zero_count
from .scale import decoupled
from .tree import map_leaves
from .validate import check_number

__all__ = ["ScaleByLionState", "scale_by_lion", "lion"]

MOMENTUM_DTYPES = (None, torch.float32, torch.bfloat16)  # how scale_by_lion may store its momentum


class ScaleByLionState(NamedTuple):
    """``count``: 0-d int32, applied updates so far. ``mu``: the momentum, like the updates.
    ``b1``, ``b2``: 0-d float64 hyperparameters."""

    count: torch.Tensor
    mu: object
    b1: torch.Tensor
    b2: torch.Tensor

    HYPERPARAMS = ("b1", "b2")


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, *, mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Lion's direction, elementwise:

    .. math::
        u = \operatorname{sign}\big((1-\beta_1)\,g + \beta_1 m\big),\qquad
        m \leftarrow (1-\beta_2)\,g + \beta_2 m

    (``sign(0) = 0``), in FP32 with the 0-d coefficients rounded to FP32 once, as optax's
    Python-float coefficients meet FP32 arrays. Elementwise, so a shard that cuts a leaf needs
    nothing from the other ranks. ``mu_dtype``: how the momentum is stored between steps --
    ``None`` (the updates' dtype, FP32 under fzero's engine), ``torch.float32`` or
    ``torch.bfloat16`` (rounded to nearest). ``b1``, ``b2`` must be in [0, 1), else ``ValueError``.
    """
    for name, value in (("b1", b1), ("b2", b2)):
        check_number("scale_by_lion", name, value, HYPERPARAM_RULES[name])
    if mu_dtype not in MOMENTUM_DTYPES:
        raise ValueError(f"scale_by_lion: mu_dtype must be None, torch.float32 or torch.bfloat16, got {mu_dtype!r}")

    def init(params, *, context: ShardContext | None = None):
        mu = optree.tree_map(lambda p: torch.zeros_like(p, dtype=mu_dtype or p.dtype), params)
        return ScaleByLionState(zero_count(params), mu, hyperparam(b1, params), hyperparam(b2, params))

    def update(updates, state, params=None, **extra):
        w1, c1 = scalar(1 - state.b1), scalar(state.b1)
        w2, c2 = scalar(1 - state.b2), scalar(state.b2)

        def leaf(g, m_old):
            g32, m = g.float(), m_old.float()
            return torch.sign(w1 * g32 + c1 * m).to(g.dtype), (w2 * g32 + c2 * m).to(m_old.dtype)

        u, mu = map_leaves(leaf, updates, state.mu, outputs=2)
        return u, state._replace(count=state.count + 1, mu=mu)

    return GradientTransformation(init, update)


def lion(lr=1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, *, weight_decay_mask=None,
         mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Lion with decoupled weight decay, ``optax.lion``'s chain: ``scale_by_lion(b1, b2)``, then
    ``add_decayed_weights(weight_decay, mask=weight_decay_mask)``, then
    ``scale_by_learning_rate(lr)``:

    .. math:: p \leftarrow p - \mathrm{lr}\,\big(\operatorname{sign}((1-\beta_1) g + \beta_1 m) + \lambda p\big)

    ``lr``: a float or a schedule ``count -> lr``; Lion's steps are all of size ``lr`` per
    element, so its ``lr`` is typically 3-10x smaller than AdamW's and its ``weight_decay``
    larger by as much (the paper's advice; optax's default ``weight_decay`` is 1e-3, torch-style
    0 here). ``weight_decay_mask``: the leaves that decay, as in ``adamw``. State: the FP32
    momentum, 4 bytes per param (2 with ``mu_dtype=torch.bfloat16``), against AdamW's 8.
    Invalid values raise ``ValueError`` here."""
    if len(betas) != 2:
        raise ValueError(f"lion: betas must be (b1, b2), got {betas!r}")
    return decoupled("lion", scale_by_lion(betas[0], betas[1], mu_dtype=mu_dtype), lr, weight_decay, weight_decay_mask)
