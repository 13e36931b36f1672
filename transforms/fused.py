"""The fused form of a transform: the same step as ``update``, in place, with one fused kernel.

A caller that holds the params as one flat FP32 tensor (fzero's engine, eager) may ask a
transform for its ``fused`` form (``GradientTransformation.fused``) instead of running
``update``; the transform answers with a ``FusedStep`` or declines with ``None``.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

__all__ = ["FusedStep", "AdamWCoefficients", "updates_params"]


class FusedStep(NamedTuple):
    """What a ``fused`` form returns for one step (see ``GradientTransformation``).

    ``kernel(params, grads, state)``: the update in place, with one of torch's fused kernels,
    on a 1-D FP32 ``params`` tensor, the FP32 ``grads`` times ``grad_scale`` like it (which it
    may overwrite), and the state with its tensors of that shape likewise; elementwise, so the
    caller may run it on consecutive slices of the three (the 0-d work is done once, in
    ``fused``). ``None`` for a transform that only rescales the grads. ``state``: the new state;
    its tensors shaped like the params are the ones ``kernel`` writes. ``grad_scale``: what the
    kernel divides the grads by (clipping multiplies it).

    ``adamw``: for AdamW on FP32 moments, a function of no arguments that computes this step's
    ``AdamWCoefficients``: what a kernel of the caller's own may run instead of ``kernel`` on the
    state's two ``[S]`` tensors, the first and second moments; else ``None``. The transform
    computes the values; a kernel that reads them lays them out as it needs (fzero's CPU kernel:
    ``fzero.cpu.native.pack``)."""

    kernel: Callable[[torch.Tensor, torch.Tensor, Any], None] | None
    state: Any
    grad_scale: torch.Tensor
    adamw: Callable[[], "AdamWCoefficients"] | None = None


class AdamWCoefficients(NamedTuple):
    """AdamW's step ``t`` as 0-d FP32 values, each computed as ``update`` computes it, so that a
    kernel running them gives ``update``'s bits: ``w1 = 1 - b1``, ``b2``, ``w2 = 1 - b2``,
    ``eps``, ``step_size = 1 / (1 - b1^t)``, ``inv_bc2 = 1 / sqrt(1 - b2^t)``, ``neg_lr = -lr``,
    ``wd`` (the decoupled weight decay)."""

    w1: torch.Tensor
    b2: torch.Tensor
    w2: torch.Tensor
    eps: torch.Tensor
    step_size: torch.Tensor
    inv_bc2: torch.Tensor
    neg_lr: torch.Tensor
    wd: torch.Tensor


def updates_params(fused) -> bool:
    """Whether a ``fused`` form may update the params in place (marked ``updates_params = True``),
    rather than only rescale the grads (clipping)."""
    return getattr(fused, "updates_params", False)
