"""Muon: momentum orthogonalized by a Newton–Schulz iteration, for 2-D (hidden) weight matrices.

``muon`` is ``torch.optim.Muon``'s update as optax composes it (``optax.contrib.muon``)::

    chain(scale_by_muon(momentum, nesterov, ns_steps, ...), add_decayed_weights(wd), scale_by_learning_rate(lr))

Per 2-D leaf ``W`` (``[A, B]``) with grad ``g`` and momentum buffer ``b`` (zero at first):

    b <- b + (1 - mu) (g - b)                      (torch's ``lerp``: an average of the grads)
    m <- g + mu (b - g)   if nesterov, else b
    O <- NS_k(m)                                   (Newton–Schulz in BF16, below)
    W <- W - lr * (r(A, B) O + wd W)               (r: ``adjust_lr_fn``; decay not adjusted)

``NS_k``: ``X = m / max(||m||_F, eps)`` in BF16 (transposed if ``A > B``, so ``X X^T`` is the
smaller Gram matrix), then ``k`` times ``X <- a X + (b G + c G G) X`` with ``G = X X^T`` and
``(a, b, c) = (3.4445, -4.7750, 2.0315)``: Keller Jordan's quintic, which pushes every singular
value of ``X`` not far below the largest towards 1 (into about [0.7, 1.2] after 5 steps), so ``O ~ U V^T`` of ``m = U S V^T``.
The same ops in the same order and dtype as ``torch.optim._muon._zeropower_via_newtonschulz``.

``r(A, B)``: ``None``/``"original"`` ``sqrt(max(1, A / B))`` (Keller Jordan's), ``"match_rms_adamw"``
``0.2 sqrt(max(A, B))`` (Moonshot's: the update's RMS that of AdamW's, so AdamW's lr and weight
decay carry over).

Muon is for hidden matrices: embeddings, the output head and 1-D params train with AdamW, which
``transforms.partition`` composes (see docs/muon.md).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import optree
import torch

from .protocol import GradientTransformation
from .combine import chain
from .context import ShardContext
from .hyperparams import HYPERPARAM_RULES
from .scalars import hyperparam, scalar
from .scale import add_decayed_weights, scale_by_learning_rate
from .tree import leaf_paths
from .validate import check_count, check_number

__all__ = ["ScaleByMuonState", "NS_COEFFICIENTS", "ADJUST_LR_FNS", "newton_schulz", "adjusted_ratio", "scale_by_muon",
           "muon"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


class ScaleByMuonState(NamedTuple):
    """``momentum_buffer``: like the params (their dtype); ``momentum``: 0-d float64."""

    momentum_buffer: object
    momentum: torch.Tensor

    HYPERPARAMS = ("momentum",)


def newton_schulz(m: torch.Tensor, *, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = 1e-7) -> torch.Tensor:
    """``[A, B]`` -> ``[A, B]`` BF16: ``steps`` quintic Newton–Schulz iterations on ``m``
    normalized by its Frobenius norm (at least ``eps``), approximately ``U V^T`` of
    ``m = U S V^T`` (see the module docstring)."""
    a, b, c = coefficients
    x = m.bfloat16()
    tall = m.size(0) > m.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_ratio(shape, adjust_lr_fn: str | None) -> float:
    """What ``adjust_lr_fn`` multiplies the learning rate by for a ``[A, B]`` matrix."""
    A, B = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, A / B))
    return 0.2 * math.sqrt(max(A, B))


def _check_matrices(params, where: str) -> None:
    paths, leaves, _ = leaf_paths(params)
    for name, leaf in zip(paths, leaves):
        if leaf.ndim != 2:
            raise ValueError(f"{where}: Muon orthogonalizes 2-D matrices; leaf {name!r} has shape {tuple(leaf.shape)} "
                             f"(train it with another transform: transforms.partition)")
        if leaf.numel() == 0:
            raise ValueError(f"{where}: leaf {name!r} has shape {tuple(leaf.shape)}, no elements: Muon has no matrix "
                             f"to orthogonalize (train it with another transform: transforms.partition)")


def scale_by_muon(momentum: float = 0.95, *, nesterov: bool = True, ns_steps: int = 5,
                  ns_coefficients=NS_COEFFICIENTS, eps: float = 1e-7, adjust_lr_fn: str | None = None
                  ) -> GradientTransformation:
    """``g -> r(A, B) NS(m)`` per 2-D leaf, ``m`` the (Nesterov) momentum (module docstring).

    Raises ``ValueError`` for a leaf that is not 2-D (at ``init``), a ``momentum`` that is not
    finite and >= 0, ``ns_steps`` not an integer in [1, 100), or an unknown ``adjust_lr_fn``."""
    momentum = check_number("scale_by_muon", "momentum", momentum, HYPERPARAM_RULES["momentum"])
    ns_steps = check_count("scale_by_muon", "ns_steps", ns_steps, minimum=1)
    if ns_steps >= 100:
        raise ValueError(f"scale_by_muon: ns_steps must be < 100, got {ns_steps}")
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"scale_by_muon: adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(f"scale_by_muon: ns_coefficients must be 3 numbers (a, b, c), got {ns_coefficients!r}")
    coefficients = tuple(float(v) for v in ns_coefficients)
    eps = check_number("scale_by_muon", "eps", eps, HYPERPARAM_RULES["eps"])

    def init(params, *, context: ShardContext | None = None):
        _check_matrices(params if context is None else context.tree, "scale_by_muon")
        return ScaleByMuonState(optree.tree_map(torch.zeros_like, params), hyperparam(momentum, params))

    def orthogonalized(m):
        """``[A, B]`` momentum -> ``r(A, B) NS(m)`` in FP32."""
        return newton_schulz(m, steps=ns_steps, coefficients=coefficients, eps=eps).float() * adjusted_ratio(
            m.shape, adjust_lr_fn)

    def update(updates, state, params=None, *, context: ShardContext | None = None, **extra):
        # 1 - mu in float64, then FP32: the weight torch's lerp_(grad, 1 - momentum) gets
        mu, keep = scalar(state.momentum), scalar(1 - state.momentum)
        buf = optree.tree_map(lambda g, b: b.lerp(g.to(b.dtype), keep), updates, state.momentum_buffer)
        ms = optree.tree_map(lambda g, b: g.to(b.dtype).lerp(b, mu), updates, buf) if nesterov else buf
        if context is None:  # the leaves are the matrices
            out = optree.tree_map(lambda m, g: orthogonalized(m).to(g.dtype), ms, updates)
        else:  # a tensor standing for them: the caller makes each matrix whole. BF16 is what
            # Newton-Schulz casts to first: the same bits, half the bytes to gather.
            out = context.whole(ms.bfloat16(), orthogonalized, dtype=torch.float32).to(updates.dtype)
        return out, state._replace(momentum_buffer=buf)

    return GradientTransformation(init, update, needs_context=True)


def muon(lr=1e-3, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, weight_decay: float = 0.0,
         adjust_lr_fn: str | None = None, *, ns_coefficients=NS_COEFFICIENTS, eps: float = 1e-7
         ) -> GradientTransformation:
    """``torch.optim.Muon`` for pytrees of 2-D leaves: ``W <- W - lr (r(A, B) NS(m) + wd W)``.

    ``lr``: a float or a schedule (as ``scale_by_learning_rate``); the decay uses ``lr``
    itself, not the adjusted one, as torch's does. ``weight_decay`` defaults to 0 (torch's
    Muon: 0.1). Invalid values raise ``ValueError`` here, as in torch.optim.Muon."""
    if not callable(lr):
        check_number("muon", "lr", lr, HYPERPARAM_RULES["lr"])
    check_number("muon", "weight_decay", weight_decay, HYPERPARAM_RULES["weight_decay"])
    return chain(scale_by_muon(momentum, nesterov=nesterov, ns_steps=ns_steps, ns_coefficients=ns_coefficients, eps=eps,
                               adjust_lr_fn=adjust_lr_fn),
                 add_decayed_weights(weight_decay),
                 scale_by_learning_rate(lr))
