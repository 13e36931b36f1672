"""SGD with momentum (torch.optim.SGD semantics, dampening 0)."""
from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from .protocol import GradientTransformation
from .combine import chain
from .context import ShardContext
from .hyperparams import HYPERPARAM_RULES
from .scalars import hyperparam, scalar
from .scale import add_decayed_weights, scale_by_learning_rate
from .validate import check_number

__all__ = ["TraceState", "trace", "sgd"]


class TraceState(NamedTuple):
    """``trace``: momentum buffer like the updates; ``momentum``: 0-d float64."""

    trace: object
    momentum: torch.Tensor

    HYPERPARAMS = ("momentum",)


def trace(momentum: float, *, nesterov: bool = False) -> GradientTransformation:
    r"""Heavy-ball momentum: :math:`b \leftarrow \mu b + g`; update :math:`b` (or
    :math:`g + \mu b` with ``nesterov``). Starting from :math:`b=0` this equals torch's
    first-step ``b = g``. ``momentum`` must be finite and >= 0, else ``ValueError``."""
    check_number("trace", "momentum", momentum, HYPERPARAM_RULES["momentum"])

    def init(params, *, context: ShardContext | None = None):
        return TraceState(optree.tree_map(torch.zeros_like, params), hyperparam(momentum, params))

    def update(updates, state, params=None, **extra):
        mu = scalar(state.momentum)
        buf = optree.tree_map(lambda g, b: (mu * b + g).to(b.dtype), updates, state.trace)
        out = optree.tree_map(lambda g, b: g + mu * b, updates, buf) if nesterov else buf
        return out, state._replace(trace=buf)

    return GradientTransformation(init, update)


def sgd(lr=1e-3, momentum: float = 0.0, *, nesterov: bool = False, weight_decay: float = 0.0, weight_decay_mask=None):
    r"""torch.optim.SGD: ``g += wd * p`` (coupled L2), momentum, ``p -= lr * update``.
    ``weight_decay_mask``: the leaves that decay, as in ``adamw``.

    Invalid values raise ``ValueError`` here, as in torch.optim.SGD: a float ``lr``,
    ``momentum`` and ``weight_decay`` must be finite and >= 0; ``nesterov`` needs momentum > 0."""
    if not callable(lr):
        check_number("sgd", "lr", lr, HYPERPARAM_RULES["lr"])
    momentum = check_number("sgd", "momentum", momentum, HYPERPARAM_RULES["momentum"])
    check_number("sgd", "weight_decay", weight_decay, HYPERPARAM_RULES["weight_decay"])
    if nesterov and momentum <= 0:
        raise ValueError(f"sgd: momentum must be > 0 with nesterov=True, got {momentum!r}")
    txs = [add_decayed_weights(weight_decay, mask=weight_decay_mask)]
    if momentum:
        txs.append(trace(momentum, nesterov=nesterov))
    txs.append(scale_by_learning_rate(lr))
    return chain(*txs)
