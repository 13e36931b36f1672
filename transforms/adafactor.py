"""Adafactor: a second moment factored into row and column statistics per matrix, a relative
step size and update clipping (``torch.optim.Adafactor``).

Shazeer and Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost" (arXiv
1804.04235), in the arrangement of ``torch.optim.Adafactor`` (``torch/optim/_adafactor.py``,
``_single_tensor_adafactor``): no first moment, ``beta2_t = 1 - t^beta2_decay``, the relative
step ``alpha = max(eps2, RMS(p)) * min(lr, 1/sqrt(t))``, the update clipped to RMS ``d``, and
decoupled weight decay ``p *= 1 - lr * weight_decay``. Without host syncs: torch's ``.item()``
calls are 0-d tensors here.

On a flat shard standing for the params (fzero's engine) nothing of it is element-wise but the
vectors' second moment: each matrix's row and column means of ``g^2``, ``RMS(p)`` and
``RMS(u)`` are over whole leaves, which the shards cut. The context reduces them over the
ranks that hold parts of a leaf (``ShardContext.matrix_means``, ``leaf_norms``: two
all-reduces per step, of ``sum(B (R + C))`` and ``2 x leaves`` FP32 values), and every rank
keeps every matrix's statistics whole (they are the same on every rank, as the all-reduce
makes them): 4 bytes per row and column, not per element.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import optree
import torch

from .protocol import GradientTransformation
from .context import ShardContext
from .hyperparams import HYPERPARAM_RULES
from .partition import PartitionState
from .scalars import hyperparam, scalar, zero_count
from .scale import ScaleByLearningRateState, ScaleByScheduleState, learning_rate, next_learning_rate_state
from .tree import map_leaves
from .validate import check_number

__all__ = ["AdafactorState", "Factored", "adafactor", "is_replicated"]


class Factored(NamedTuple):
    """A matrix's (a leaf of 2 or more dims) second moment, factored over its last two dims:
    ``row`` ``[..., R, 1]`` (the mean of ``g^2`` over each row), ``col`` ``[..., 1, C]`` (over
    each column): ``4 (R + C)`` bytes per matrix in FP32. On a shard (fzero's engine) every rank
    holds it whole, the same values: a checkpoint stores it once (``is_replicated``)."""

    row: torch.Tensor
    col: torch.Tensor


def is_replicated(x) -> bool:
    """Whether ``x`` is a state node whose tensors every rank holds whole and alike (``Factored``)
    rather than a shard of: what a checkpoint stores once, from one rank; use it as optree's
    ``is_leaf``."""
    return isinstance(x, Factored)


class AdafactorState(NamedTuple):
    """``count``: 0-d int32, applied updates. ``moments``: on a params pytree, per leaf a
    ``Factored`` (matrices) or the full second moment like the leaf (vectors, scalars); on a
    flat shard, a ``PartitionState`` of the shard's elements by group (``"factored"``: a
    ``Factored`` per matrix, in leaf order; ``"full"``: FP32 like the other leaves' elements,
    compacted). ``lr``: the learning rate's state (``transforms.scale``: a constant's 0-d
    ``lr``, or a schedule's count). ``beta2_decay``, ``eps1``, ``eps2``, ``d``,
    ``weight_decay``: 0-d float64 hyperparameters (``eps1`` the FP32 machine epsilon unless
    given, as torch takes the params' dtype's: a shard's are the FP32 master's)."""

    count: torch.Tensor
    moments: object
    lr: object
    beta2_decay: torch.Tensor
    eps1: torch.Tensor
    eps2: torch.Tensor
    d: torch.Tensor
    weight_decay: torch.Tensor

    HYPERPARAMS = ("beta2_decay", "eps1", "eps2", "d", "weight_decay")


def _factored_zeros(p: torch.Tensor, like: torch.Tensor) -> Factored:
    """A zero ``Factored`` for a matrix shaped like ``p``, on ``like``'s device."""
    return Factored(like.new_zeros((*p.shape[:-1], 1), dtype=torch.float32),
                    like.new_zeros((*p.shape[:-2], 1, p.shape[-1]), dtype=torch.float32))


def _labels(tree) -> list[str]:
    """The group of each leaf of ``tree`` on a shard: ``"factored"`` (2 or more dims) or ``"full"``."""
    return ["factored" if x.ndim >= 2 else "full" for x in optree.tree_leaves(tree)]


def _ema(m, stats, w: torch.Tensor):
    """The moment ``m`` moved to ``stats`` by ``w`` (``1 - beta2_t``): a ``Factored`` row and
    column each to its mean of ``g^2``, a full moment to ``g^2``."""
    if isinstance(m, Factored):
        return Factored(torch.lerp(m.row, stats[0], w), torch.lerp(m.col, stats[1], w))
    return torch.lerp(m, stats, w)


def _row_over_mean(f: Factored, eps1: torch.Tensor) -> torch.Tensor:
    """``row / mean(row)`` per matrix (the mean clamped to at least ``eps1``): ``v = R C / mean(R)``
    is this times ``col``."""
    return f.row / f.row.mean(-2, keepdim=True).clamp(min=eps1)


def _step(u, p32, p_rms, u_rms, eps2, d, rho, decay) -> torch.Tensor:
    r"""``-alpha / max(1, RMS(u) / d) * u - lr * weight_decay * p``, ``alpha = max(eps2, RMS(p)) * rho``."""
    alpha = torch.maximum(eps2, p_rms) * rho
    return -(alpha / torch.clamp(u_rms / d, min=1.0)) * u - decay * p32


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
    schedule ``count -> lr``. The elementwise math is FP32; on a params pytree the 0-d
    coefficients are float64, on a shard FP32 per element (the module doc says what the
    shard's context reduces). Arguments are checked as torch checks them (``ValueError``
    naming the argument)."""
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
        if context is None:
            moments = optree.tree_map(lambda p: _factored_zeros(p, p) if p.ndim >= 2 else
                                      torch.zeros_like(p, dtype=torch.float32), params)
        else:  # a flat shard: its elements grouped into matrices' and others'
            parts = context.split(_labels).parts
            inner = {}
            if "factored" in parts:
                inner["factored"] = tuple(_factored_zeros(x, params) for x in optree.tree_leaves(parts["factored"].tree))
            if "full" in parts:
                inner["full"] = params.new_zeros(parts["full"].numel, dtype=torch.float32)
            moments = PartitionState(inner)
        leaves = optree.tree_leaves(params)
        eps1 = eps[0] if eps[0] is not None else torch.finfo(leaves[0].dtype if leaves else torch.float32).eps
        lr_state = ScaleByScheduleState(zero_count(params)) if callable(lr) else ScaleByLearningRateState(hyperparam(lr, params))
        return AdafactorState(zero_count(params), moments, lr_state,
                              *(hyperparam(v, params) for v in (beta2_decay, eps1, eps[1], d, weight_decay)))

    def update(updates, state, params=None, *, context: ShardContext | None = None, **extra):
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
            sq = g32 * g32
            m = _ema(m, (sq.mean(-1, keepdim=True), sq.mean(-2, keepdim=True)) if isinstance(m, Factored) else sq, w)
            v = _row_over_mean(m, eps1) * m.col if isinstance(m, Factored) else m
            u = g32 * v.clamp(min=eps1_sq).rsqrt()
            n = math.sqrt(p.numel())
            step = _step(u, p32, p32.norm().double() / n, u.norm().double() / n, state.eps2, state.d, rho, decay)
            return step.to(g.dtype), m

        def group(g, p, m, part: ShardContext):
            """A shard's group (``_labels``) as one: the statistics over whole leaves from ``part``."""
            g32, p32 = g.float(), p.float()
            sq = g32 * g32
            if isinstance(m, tuple):  # the group's matrices
                m = tuple(_ema(f, stats, w) for f, stats in zip(m, part.matrix_means(sq)))
                v = part.outer([(_row_over_mean(f, eps1), f.col) for f in m])
            else:
                m = v = _ema(m, sq, w)
            u = g32 * v.clamp(min=eps1_sq).rsqrt()
            p_rms, u_rms = part.leaf_norms(p32, u, rms=True)
            return _step(u, p32, p_rms, u_rms, state.eps2, state.d, rho, decay).to(g.dtype), m

        if context is None:
            u, moments = map_leaves(leaf, updates, params, state.moments, outputs=2)
        else:
            split = context.split(_labels)
            gs, ps, inner = split.take(updates), split.take(params), dict(state.moments.inner_states)
            out = {}
            for k, part in split.parts.items():
                out[k], inner[k] = group(gs[k], ps[k], inner[k], part)
            u, moments = split.join(out), PartitionState(inner)
        return u, state._replace(count=count, moments=moments, lr=next_learning_rate_state(lr, state.lr, lambda c: c + 1))

    return GradientTransformation(init, update, None, lambda state: {"lr": learning_rate(lr, state.lr)}, needs_context=True)
