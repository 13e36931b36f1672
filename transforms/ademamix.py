"""AdEMAMix: Adam with a second, slow momentum mixed into the numerator (optax's
``contrib.ademamix``).

Pagliardini, Ablin and Grangier, "The AdEMAMix Optimizer: Better, Faster, Older" (arXiv
2409.03137), Algorithm 1; the arrangement and the defaults of ``optax.contrib.scale_by_ademamix``
and ``optax.contrib.ademamix`` (optax ``contrib/_ademamix.py``), with torch-style argument names
as ``adamw`` has.
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

__all__ = ["ScaleByAdemamixState", "scale_by_ademamix", "ademamix"]


class ScaleByAdemamixState(NamedTuple):
    """``count``: 0-d int32, applied updates so far (optax keeps a second count for the slow
    momentum's schedules, always equal to this one). ``m1``, ``m2``: the fast and the slow
    momentum, ``nu``: the second moment, each like the updates. ``b1``, ``b2``, ``b3``, ``alpha``,
    ``eps``: 0-d float64 hyperparameters."""

    count: torch.Tensor
    m1: object
    m2: object
    nu: object
    b1: torch.Tensor
    b2: torch.Tensor
    b3: torch.Tensor
    alpha: torch.Tensor
    eps: torch.Tensor

    HYPERPARAMS = ("b1", "b2", "b3", "alpha", "eps")


def scale_by_ademamix(b1: float = 0.9, b2: float = 0.999, b3: float = 0.9999, alpha: float = 5.0,
                      eps: float = 1e-8) -> GradientTransformation:
    r"""AdEMAMix's direction, elementwise:

    .. math::
        t \leftarrow t+1,\quad m_1 \leftarrow \beta_1 m_1 + (1-\beta_1) g,\quad
        m_2 \leftarrow \beta_3 m_2 + (1-\beta_3) g,\quad
        \nu \leftarrow \beta_2 \nu + (1-\beta_2) g^2,\\
        u = \frac{m_1 / (1-\beta_1^t) + \alpha\, m_2}{\sqrt{\nu / (1-\beta_2^t)} + \epsilon}

    (the slow momentum ``m_2`` is not bias-corrected: it fills slowly, as the paper means it to).
    The elementwise arithmetic is FP32, the 0-d bias corrections float64 then FP32; the moments
    are stored in the updates' dtype (FP32 under fzero's engine): 12 bytes per param. Elementwise,
    so a shard that cuts a leaf needs nothing from the other ranks. ``b1``, ``b2``, ``b3`` must
    be in [0, 1), ``alpha`` and ``eps`` finite and >= 0, else ``ValueError``.
    """
    for name, value in (("b1", b1), ("b2", b2), ("b3", b3), ("alpha", alpha), ("eps", eps)):
        check_number("scale_by_ademamix", name, value, HYPERPARAM_RULES[name])

    def init(params, *, context: ShardContext | None = None):
        zeros = lambda: optree.tree_map(torch.zeros_like, params)  # noqa: E731
        return ScaleByAdemamixState(zero_count(params), zeros(), zeros(), zeros(),
                                    *(hyperparam(v, params) for v in (b1, b2, b3, alpha, eps)))

    def update(updates, state, params=None, **extra):
        count = state.count + 1
        t = count.to(torch.float64)
        inv_bc1 = scalar(1 / (1 - state.b1**t))
        inv_bc2 = scalar(1 / (1 - state.b2**t))
        w1, c1 = scalar(1 - state.b1), scalar(state.b1)
        w2, c2 = scalar(1 - state.b2), scalar(state.b2)
        w3, c3 = scalar(1 - state.b3), scalar(state.b3)
        alpha_, eps_ = scalar(state.alpha), scalar(state.eps)

        def leaf(g, m1_old, m2_old, nu_old):
            g32 = g.float()
            m1 = w1 * g32 + c1 * m1_old.float()
            m2 = w3 * g32 + c3 * m2_old.float()
            nu = w2 * g32 * g32 + c2 * nu_old.float()
            u = (m1 * inv_bc1 + alpha_ * m2) / ((nu * inv_bc2).sqrt() + eps_)
            return u.to(g.dtype), m1.to(m1_old.dtype), m2.to(m2_old.dtype), nu.to(nu_old.dtype)

        u, m1, m2, nu = map_leaves(leaf, updates, state.m1, state.m2, state.nu, outputs=4)
        return u, state._replace(count=count, m1=m1, m2=m2, nu=nu)

    return GradientTransformation(init, update)


def ademamix(lr=1e-3, betas: tuple[float, float, float] = (0.9, 0.999, 0.9999), alpha: float = 5.0,
             eps: float = 1e-8, weight_decay: float = 0.0, *, weight_decay_mask=None) -> GradientTransformation:
    r"""AdEMAMix with decoupled weight decay, ``optax.contrib.ademamix``'s chain:
    ``scale_by_ademamix(b1, b2, b3, alpha, eps)``, then ``add_decayed_weights(weight_decay,
    mask=weight_decay_mask)``, then ``scale_by_learning_rate(lr)``:

    .. math:: p \leftarrow p - \mathrm{lr}\,\big(u + \lambda p\big)

    ``lr``: a float or a schedule ``count -> lr``. ``betas``: ``(b1, b2, b3)``, the fast
    momentum's, the second moment's and the slow momentum's decays; ``alpha`` weighs the slow
    momentum. The paper warms ``alpha`` and ``b3`` up over the run for stability; here they are
    constants (``set_hyperparams`` changes them between steps without a recompile).
    ``weight_decay_mask``: the leaves that decay, as in ``adamw``. State: three FP32 moments, 12
    bytes per param, against AdamW's 8. Invalid values raise ``ValueError`` here."""
    if len(betas) != 3:
        raise ValueError(f"ademamix: betas must be (b1, b2, b3), got {betas!r}")
    return decoupled("ademamix", scale_by_ademamix(*betas, alpha=alpha, eps=eps), lr, weight_decay, weight_decay_mask)
