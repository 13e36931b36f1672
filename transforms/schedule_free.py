"""Schedule-Free AdamW (optax's ``contrib.schedule_free_adamw``) and its evaluation params.

Defazio et al., "The Road Less Scheduled" (arXiv 2405.15682); the arrangement and the defaults
of ``optax.contrib.schedule_free`` and ``schedule_free_adamw`` (optax ``contrib/_schedule_free.py``),
with torch-style argument names as ``adamw`` has. The params the transform updates are the
sequence ``y`` the gradient is taken at; the state keeps ``z``, and the averaged sequence
``x = (y - (1 - b1) z) / b1`` -- the params to evaluate and export -- is computed from the two
(``schedule_free_eval_params``; under fzero's engine ``engine.params_from(params, state,
schedule_free_eval_params)`` gathers them from every rank).
"""
from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from .protocol import GradientTransformation
from .context import ShardContext
from .hyperparams import HYPERPARAM_RULES
from .scalars import first_device, hyperparam, scalar, zero_count
from .scale import decoupled, learning_rate
from .schedules import linear_warmup
from .tree import map_leaves, named_tuples
from .validate import check_count, check_number

__all__ = ["ScheduleFreeState", "ScaleByRmsState", "schedule_free_adamw", "schedule_free_eval_params"]

LR_STATE = 2  # where the momentum-free AdamW chain keeps its learning rate's state


class ScaleByRmsState(NamedTuple):
    """``count``: 0-d int32; ``nu``: the second moment, like the updates; ``b2``, ``eps``: 0-d
    float64 hyperparameters."""

    count: torch.Tensor
    nu: object
    b2: torch.Tensor
    eps: torch.Tensor

    HYPERPARAMS = ("b2", "eps")


def _scale_by_rms(b2: float, eps: float) -> GradientTransformation:
    r"""Adam's direction without its first moment: :math:`u = g / (\sqrt{\nu / (1-\beta_2^t)} + \epsilon)`
    (``optax.scale_by_rms(decay=b2, eps=eps, eps_in_sqrt=False, bias_correction=True)``, which
    ``schedule_free_adamw`` builds on: the momentum is Schedule-Free's own)."""

    def init(params, *, context: ShardContext | None = None):
        return ScaleByRmsState(zero_count(params), optree.tree_map(torch.zeros_like, params),
                               hyperparam(b2, params), hyperparam(eps, params))

    def update(updates, state, params=None, **extra):
        count = state.count + 1
        inv_bc = scalar(1 / (1 - state.b2 ** count.to(torch.float64)))
        w, c, eps_ = scalar(1 - state.b2), scalar(state.b2), scalar(state.eps)

        def leaf(g, nu_old):
            g32 = g.float()
            nu = w * g32 * g32 + c * nu_old.float()
            return (g32 / ((nu * inv_bc).sqrt() + eps_)).to(g.dtype), nu.to(nu_old.dtype)

        u, nu = map_leaves(leaf, updates, state.nu, outputs=2)
        return u, state._replace(count=count, nu=nu)

    return GradientTransformation(init, update)


class ScheduleFreeState(NamedTuple):
    """``b1``, ``weight_lr_power``: 0-d float64 hyperparameters. ``weight_sum``, ``max_lr``: 0-d
    FP32 (optax keeps them in the params' dtype): the running sum of the averaging weights
    ``max_lr ** weight_lr_power`` and the largest learning rate so far. ``step_count``: 0-d
    int32, 1 at init (the count optax's learning-rate schedule reads here). ``inner``: the
    state of the momentum-free AdamW (``_scale_by_rms``, decay, learning rate). ``z``: the
    sequence the base steps move, like the params."""

    b1: torch.Tensor
    weight_lr_power: torch.Tensor
    weight_sum: torch.Tensor
    max_lr: torch.Tensor
    step_count: torch.Tensor
    inner: object
    z: object

    HYPERPARAMS = ("b1", "weight_lr_power")
    # narrower than HYPERPARAM_RULES["b1"]: the evaluation params divide by b1
    RULES = {"b1": (lambda v: 0.0 < v < 1.0, "in (0, 1): x is (y - (1 - b1) z) / b1")}


def schedule_free_eval_params(state, params):
    """The evaluation params ``x = (y - (1 - b1) z) / b1`` of the ``ScheduleFreeState`` in
    ``state`` (a transform state holding one, e.g. a chain's), for ``params`` ``y``: a pytree
    like ``params`` (optax's ``schedule_free_eval_params``). Elementwise: under fzero's engine
    pass it to ``engine.params_from``, which applies it to this rank's shard and gathers."""
    found = [s for s in named_tuples(state) if isinstance(s, ScheduleFreeState)]
    if len(found) != 1:
        raise ValueError(f"schedule_free_eval_params: the state holds {len(found)} ScheduleFreeState(s), not one "
                         "(a transform state of schedule_free_adamw)")
    sf = found[0]
    b1 = scalar(sf.b1)
    return optree.tree_map(lambda y, z: ((y.float() - (1 - b1) * z.float()) / b1).to(y.dtype), params, sf.z)


def schedule_free_adamw(lr=0.0025, warmup_steps: int = 0, betas: tuple[float, float] = (0.9, 0.999),
                        eps: float = 1e-8, weight_decay: float = 0.0, weight_lr_power: float = 2.0, *,
                        weight_decay_mask=None) -> GradientTransformation:
    r"""Schedule-Free AdamW, ``optax.contrib.schedule_free_adamw``: the momentum-free AdamW step
    (``_scale_by_rms(b2, eps)``, ``add_decayed_weights(weight_decay, mask)``,
    ``scale_by_learning_rate(lr)``) moves ``z``, and the params ``y`` follow

    .. math::
        z_{t+1} = z_t + \Delta_t,\quad
        x_{t+1} = (1 - c_t)\, x_t + c_t\, z_{t+1},\quad
        y_{t+1} = \beta_1 x_{t+1} + (1 - \beta_1) z_{t+1},

    with :math:`x_t = (y_t - (1-\beta_1) z_t)/\beta_1` recomputed from the two stored sequences
    and :math:`c_t = w_t / \sum_{s \le t} w_s`, :math:`w_t = (\max_{s \le t} \mathrm{lr}_s)^{p}`
    (``p = weight_lr_power``). ``lr``: a float, with ``warmup_steps`` of linear warmup from 0
    (optax's ``warmup_constant_schedule``), or a schedule ``count -> lr``; as in optax the
    averaging weight reads the schedule at the wrapper's count (1 at the first step), the step
    at the base's (0). No decay schedule is needed: that is the method's point. Evaluate and
    export ``schedule_free_eval_params``. ``betas = (b1, b2)``: ``b1`` the interpolation (> 0),
    ``b2`` the second moment's decay. ``weight_decay_mask``: the leaves that decay, as in
    ``adamw`` (optax's alias decays every leaf). State: ``z`` and the second moment, 8 bytes
    per param (AdamW's). Invalid values raise ``ValueError`` here."""
    if len(betas) != 2:
        raise ValueError(f"schedule_free_adamw: betas must be (b1, b2), got {betas!r}")
    b1, b2 = betas
    check_number("schedule_free_adamw", "betas[0]", b1, ScheduleFreeState.RULES["b1"])
    check_number("schedule_free_adamw", "betas[1]", b2, HYPERPARAM_RULES["b2"])
    check_number("schedule_free_adamw", "eps", eps, HYPERPARAM_RULES["eps"])
    check_number("schedule_free_adamw", "weight_lr_power", weight_lr_power, HYPERPARAM_RULES["weight_lr_power"])
    check_count("schedule_free_adamw", "warmup_steps", warmup_steps, minimum=0)
    if not callable(lr):
        check_number("schedule_free_adamw", "lr", lr, HYPERPARAM_RULES["lr"])
        if warmup_steps:
            lr = linear_warmup(0.0, lr, warmup_steps)
    schedule = lr if callable(lr) else None
    # its state: (rms, decay, lr), the lr state at LR_STATE
    base = decoupled("schedule_free_adamw", _scale_by_rms(b2, eps), lr, weight_decay, weight_decay_mask)

    def init(params, *, context: ShardContext | None = None):
        zero = torch.zeros((), dtype=torch.float32, device=first_device(params))
        return ScheduleFreeState(hyperparam(b1, params), hyperparam(weight_lr_power, params), zero, zero.clone(),
                                 zero_count(params) + 1, base.init(params, context=context),
                                 optree.tree_map(lambda p: p.detach().clone(), params))

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("schedule_free_adamw needs params (the sequence y the gradient was taken at)")
        # a schedule at the wrapper's count (optax's); a constant rate from the base's lr state
        # (chain member 2), so that set_hyperparams(lr=) moves both
        rate = schedule(state.step_count) if schedule is not None else learning_rate(lr, state.inner[LR_STATE])
        max_lr = torch.maximum(state.max_lr, torch.as_tensor(rate).to(torch.float32))
        weight = max_lr ** scalar(state.weight_lr_power)
        total = state.weight_sum + weight
        # optax's guard: 0/0 (no weight yet: a zero learning rate) is no averaging step, a NaN stays NaN
        ck = torch.where(weight.isnan() | total.isnan(), torch.full_like(weight, float("nan")),
                         torch.nan_to_num(weight / total, nan=0.0, posinf=float("inf")))
        base_updates, inner = base.update(updates, state.inner, params, **extra)
        b1_ = scalar(state.b1)

        def leaf(y, z_old, u):
            z = z_old.float() + u.float()
            x = (y.float() - (1 - b1_) * z_old.float()) / b1_
            x = (1 - ck) * x + ck * z
            return (b1_ * x + (1 - b1_) * z - y.float()).to(y.dtype), z.to(z_old.dtype)

        new_updates, z = map_leaves(leaf, params, state.z, base_updates, outputs=2)
        return new_updates, state._replace(weight_sum=total, max_lr=max_lr, step_count=state.step_count + 1,
                                           inner=inner, z=z)

    # the learning rate the next base step applies (a schedule's at the base's count)
    return GradientTransformation(init, update, None, lambda state: base.hyperparams(state.inner))
