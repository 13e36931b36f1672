"""Adafactor: a second moment factored into row and column statistics per matrix, a relative
step size and update clipping (``torch.optim.Adafactor``).

Shazeer and Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost" (arXiv
1804.04235), in the arrangement of ``torch.optim.Adafactor`` (``torch/optim/_adafactor.py``,
``_single_tensor_adafactor``): no first moment, ``beta2_t = 1 - t^beta2_decay``, the relative
step ``alpha = max(eps2, RMS(p)) * min(lr, 1/sqrt(t))``, the update clipped to RMS ``d``, and
decoupled weight decay ``p *= 1 - lr * weight_decay``. Without host syncs: torch's ``.item()``
calls are 0-d tensors here.

On a params pytree only, for now: fzero's engine shards its state element-wise, and a matrix's
row and column statistics are not element-wise state (docs/optimizers.md says what sharding
them takes); ``fzero.zero1`` with it stops at ``init`` saying so.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import optree
import torch

from .protocol import GradientTransformation
from .context import ShardContext
from .hyperparams import HYPERPARAM_RULES
from .scalars import hyperparam, scalar, zero_count
from .scale import ScaleByLearningRateState, ScaleByScheduleState, learning_rate, next_learning_rate_state
from .tree import map_leaves
from .validate import check_number

__all__ = ["AdafactorState", "Factored", "adafactor"]


class Factored(NamedTuple):
    """A matrix's (a leaf of 2 or more dims) second moment, factored over its last two dims:
    ``row`` ``[..., R, 1]`` (the mean of ``g^2`` over each row), ``col`` ``[..., 1, C]`` (over
    each column): ``4 (R + C)`` bytes per matrix in FP32."""

    row: torch.Tensor
    col: torch.Tensor


class AdafactorState(NamedTuple):
    """``count``: 0-d int32, applied updates. ``moments``: per leaf a ``Factored`` (matrices)
    or the full second moment like the leaf (vectors, scalars). ``lr``: the learning rate's
    state (``transforms.scale``: a constant's 0-d ``lr``, or a schedule's count).
    ``beta2_decay``, ``eps1``, ``eps2``, ``d``, ``weight_decay``: 0-d float64 hyperparameters
    (``eps1`` the FP32 machine epsilon unless given, as torch takes the params' dtype's)."""

    count: torch.Tensor
    moments: object
    lr: object
    beta2_decay: torch.Tensor
    eps1: torch.Tensor
    eps2: torch.Tensor
    d: torch.Tensor
    weight_decay: torch.Tensor

    HYPERPARAMS = ("beta2_decay", "eps1", "eps2", "d", "weight_decay")


def adafactor(lr=1e-2, beta2_decay: float = -0.8, eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0,
              weight_decay: float = 0.0) -> GradientTransformation:
    r"""``torch.optim.Adafactor`` as a transform. Per leaf ``p`` with grad ``g``, at step
    :math:`t`:

    .. math::
        \beta_{2,t} = 1 - t^{c},\quad \rho_t = \min(\mathrm{lr}, 1/\sqrt t),\quad
        \alpha_t = \max(\epsilon_2, \mathrm{RMS}(p))\,\rho_t,\\
        \hat v = \frac{R\,C}{\mathrm{mean}(R)}\ \text{(matrices: } R \leftarrow
        \mathrm{lerp}(R, \overline{g^2}^{\,\mathrm{rows}}, 1-\beta_{2,t}),\ C \text{ likewise)},\quad
        \hat v = \mathrm{lerp}(v, g^2, 1-\beta_{2,t})\ \text{(others)},\\
        u = g / \sqrt{\max(\hat v, \epsilon_1^2)},\quad
        p \leftarrow p\,(1 - \mathrm{lr}\,\lambda) - \frac{\alpha_t}{\max(1, \mathrm{RMS}(u)/d)}\, u

    (``c = beta2_decay``, ``mean(R)`` clamped to at least ``eps1``). ``lr``: a float or a
    schedule ``count -> lr``. The elementwise math is FP32, the 0-d coefficients float64.
    Arguments are checked as torch checks them (``ValueError`` naming the argument)."""
    if not callable(lr):
        check_number("adafactor", "lr", lr, HYPERPARAM_RULES["lr"])
    check_number("adafactor", "beta2_decay", beta2_decay, HYPERPARAM_RULES["beta2_decay"])
    if len(eps) != 2:
        raise ValueError(f"adafactor: eps must be (eps1, eps2), eps1 None for the dtype's epsilon, got {eps!r}")
    if eps[0] is not None:
        check_number("adafactor", "eps[0]", eps[0], HYPERPARAM_RULES["eps1"])
    check_number("adafactor", "eps[1]", eps[1], HYPERPARAM_RULES["eps2"])
    check_number("adafactor", "d", d, HYPERPARAM_RULES["d"])
    check_number("adafactor", "weight_decay", weight_decay, HYPERPARAM_RULES["weight_decay"])

    def init(params, *, context: ShardContext | None = None):
        if context is not None:
            raise ValueError("adafactor keeps each matrix's row and column statistics, which fzero's engine does not "
                             "shard yet (its state is element-wise): run transforms.adafactor on a params pytree "
                             "(tx.init, tx.update), or another optimizer under fzero.zero1")

        def moment(p):
            if p.ndim < 2:
                return torch.zeros_like(p, dtype=torch.float32)
            return Factored(p.new_zeros((*p.shape[:-1], 1), dtype=torch.float32),
                            p.new_zeros((*p.shape[:-2], 1, p.shape[-1]), dtype=torch.float32))

        leaves = optree.tree_leaves(params)
        eps1 = eps[0] if eps[0] is not None else torch.finfo(leaves[0].dtype if leaves else torch.float32).eps
        lr_state = ScaleByScheduleState(zero_count(params)) if callable(lr) else ScaleByLearningRateState(hyperparam(lr, params))
        return AdafactorState(zero_count(params), optree.tree_map(moment, params), lr_state,
                              *(hyperparam(v, params) for v in (beta2_decay, eps1, eps[1], d, weight_decay)))

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("adafactor needs params (its relative step size and weight decay)")
        count = state.count + 1
        t = count.to(torch.float64)
        rate = torch.as_tensor(learning_rate(lr, state.lr)).to(torch.float64)
        w = scalar(t ** state.beta2_decay)  # 1 - beta2_t
        rho = torch.minimum(rate, t.rsqrt())
        eps1, eps1_sq = scalar(state.eps1), scalar(state.eps1 * state.eps1)
        decay = scalar(rate * state.weight_decay)

        def leaf(g, p, m):
            g32, p32 = g.float(), p.float()
            n = math.sqrt(p.numel())
            alpha = torch.maximum(state.eps2, p32.norm().double() / n) * rho
            if isinstance(m, Factored):
                row = torch.lerp(m.row, (g32 * g32).mean(-1, keepdim=True), w)
                col = torch.lerp(m.col, (g32 * g32).mean(-2, keepdim=True), w)
                v = (row @ col) / row.mean(-2, keepdim=True).clamp(min=eps1)
                new_m = Factored(row, col)
            else:
                new_m = v = torch.lerp(m, g32 * g32, w)
            u = g32 * v.clamp(min=eps1_sq).rsqrt()
            denom = torch.clamp(u.norm().double() / (n * state.d), min=1.0)
            return (-scalar(alpha / denom) * u - decay * p32).to(g.dtype), new_m

        u, moments = map_leaves(leaf, updates, params, state.moments, outputs=2)
        return u, state._replace(count=count, moments=moments, lr=next_learning_rate_state(lr, state.lr, lambda c: c + 1))

    return GradientTransformation(init, update, None, lambda state: {"lr": learning_rate(lr, state.lr)})
