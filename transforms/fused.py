"""The fused form of a transform: the same step as ``update``, in place, with one fused kernel.

A caller that holds the params as one flat FP32 tensor (fzero's engine, eager) may ask a
transform for its ``fused`` form (``GradientTransformation.fused``) instead of running
``update``; the transform answers with a ``FusedStep`` or declines with ``None``.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

__all__ = ["FusedStep", "updates_params"]


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
    AdamW coefficients as one FP32 ``[8]`` tensor, in the order ``fzero.cpu.native.COEFFICIENTS``
    names them, each the 0-d value ``update`` computes for it, as it computes it: what a kernel
    of the caller's own may run instead of ``kernel`` on the state's two ``[S]`` tensors, the
    first and second moments; else ``None``. The transform computes the values; the kernel that
    reads them owns their layout."""

    kernel: Callable[[torch.Tensor, torch.Tensor, Any], None] | None
    state: Any
    grad_scale: torch.Tensor
    adamw: Callable[[], torch.Tensor] | None = None


def updates_params(fused) -> bool:
    """Whether a ``fused`` form may update the params in place (marked ``updates_params = True``),
    rather than only rescale the grads (clipping)."""
    return getattr(fused, "updates_params", False)
