"""0-d tensors of transform states and steps: hyperparameters, counts, and ``scalar``.

Public as ``transforms.scalar`` and ``transforms.hyperparam``: for writing transforms (and for
fzero's engine, whose step math follows the same rule as the transforms').
"""
from __future__ import annotations

import optree
import torch

__all__ = ["scalar", "hyperparam", "host_value", "with_host_value", "zero_count", "first_device"]


def scalar(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x`` (0-d) as a 0-d ``dtype`` tensor computed once per step.

    Exactly ``x.to(dtype)``. The detour through a 16-element sum is for ``torch.compile``:
    inductor inlines 0-d pointwise math into its consumers, so a bias correction
    (``float64`` pow, sqrt) would be recomputed for every element of an ``[S]`` kernel (many
    times slower on CPU, docs/performance.md); a reduction of more than 8 elements is always materialized first."""
    x = x.to(dtype).reshape(1)
    return torch.cat([x, x.new_zeros(15)]).sum()


def first_device(params) -> torch.device | None:
    """The device of the first leaf of ``params`` (``None`` for a pytree without leaves: the
    default device): where a transform's 0-d state tensors live. The transforms get it only
    through ``hyperparam`` and ``zero_count``."""
    leaves = optree.tree_leaves(params)
    return leaves[0].device if leaves else None


def hyperparam(value: float, params) -> torch.Tensor:
    """A 0-d float64 tensor on the params' device: a hyperparameter that may change in training.

    float64 so that ``0.999`` is 0.999 (as a Python float is in torch.optim): an fp32 ``b2``
    puts a 1.3e-5 relative error into ``1 - b2``. Only 0-d scalars are computed in float64;
    they are cast to fp32 (``scalar``) before touching the ``[S]`` tensors.

    The tensor remembers the Python number it was made from (``host_value``), so that a kernel
    that takes hyperparameters as Python floats (torch's fused AdamW) gets them without reading
    the device."""
    return with_host_value(torch.tensor(float(value), dtype=torch.float64, device=first_device(params)), value)


def with_host_value(t: torch.Tensor, value) -> torch.Tensor:
    """``t`` (a 0-d tensor made from ``value``), marked with ``value`` for ``host_value``."""
    t._host_value = float(value)
    return t


def host_value(t: torch.Tensor) -> float | None:
    """The Python number a 0-d hyperparameter tensor was made from (by ``hyperparam``,
    ``set_hyperparams`` or a checkpoint load), or ``None`` for any other tensor (e.g. one that
    arithmetic produced). Reads no tensor memory: no device sync."""
    return getattr(t, "_host_value", None)


def zero_count(params) -> torch.Tensor:
    """A 0-d int32 zero on the params' device: a count of applied updates, at init."""
    return torch.zeros((), dtype=torch.int32, device=first_device(params))
