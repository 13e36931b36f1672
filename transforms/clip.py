"""Clipping by the global L2 norm."""
from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from .protocol import GradientTransformation
from .context import ShardContext
from .fused import FusedStep
from .hyperparams import HYPERPARAM_RULES
from .scalars import hyperparam, scalar
from .validate import check_number

__all__ = ["ClipByGlobalNormState", "clip_by_global_norm", "global_norm"]


class ClipByGlobalNormState(NamedTuple):
    max_norm: torch.Tensor

    HYPERPARAMS = ("max_norm",)


def global_norm(tree) -> torch.Tensor:
    """``sqrt(sum of squares of every element)``, accumulated in FP32."""
    return torch.sqrt(sum(torch.sum(x.float() * x.float()) for x in optree.tree_leaves(tree)))


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """``u -> u * min(1, max_norm / (norm + 1e-6))`` (torch.nn.utils.clip_grad_norm_'s rule).

    ``norm`` is the ``grad_norm`` the caller passes (fzero's engine passes the norm over all
    ranks' shards of the averaged, unscaled grads); without one it is the norm of ``updates``.
    The norm is of the *incoming gradients*, so put this first in a ``chain``. ``max_norm`` must
    be finite and > 0, else ``ValueError``.
    """
    check_number("clip_by_global_norm", "max_norm", max_norm, HYPERPARAM_RULES["max_norm"])

    def init(params, *, context: ShardContext | None = None):
        return ClipByGlobalNormState(hyperparam(max_norm, params))

    def coefficient(state, norm):
        return torch.clamp(state.max_norm / (norm.double() + 1e-6), max=1.0)

    def update(updates, state, params=None, *, grad_norm=None, **extra):
        coef = scalar(coefficient(state, global_norm(updates) if grad_norm is None else grad_norm))
        return optree.tree_map(lambda u: (u * coef).to(u.dtype), updates), state

    def fused(state, *, grad_scale, found_inf, grad_norm):
        # Clipping multiplies the grads by coef: the kernel divides them by grad_scale / coef.
        return FusedStep(None, state, grad_scale / scalar(coefficient(state, grad_norm)))

    return GradientTransformation(init, update, fused)
