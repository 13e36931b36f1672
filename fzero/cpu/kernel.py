"""fzero's own CPU kernels (``fzero.cpu.native``) as the step's variants: the AdamW update
(``Native``, with ``native_update``) and the norm's sum of squares (``NativeNorm``). Each declines
what the kernel cannot take at this step's values and runs the fallback the plan gave it.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fzero.transforms import FusedStep

from ..cast import IntoLeaves, NewTensor
from ..flat import tree_leaves, tree_map
from ..grad_forms import Segments
from ..norm import NORM_BLOCK, NORM_ROW, sum_of_squares
from ..update import ShardGrads
from . import native

__all__ = ["native_update", "native_fused", "native_runs", "native_sum_of_squares", "Native", "NativeNorm"]

# The grads the kernels read (the norm's sum of squares and the AdamW update), and the params the
# update writes
_NATIVE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _reads(parts) -> bool:
    """Whether the kernels read the grads ``parts`` as they are: contiguous FP16, BF16 or FP32 CPU pieces."""
    return all(p.dtype in _NATIVE_DTYPES and p.device.type == "cpu" and p.is_contiguous() for p in parts)


def native_update(tx, fused: FusedStep, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk,
                  donate, out, compiled=None, cast=True):
    """The update at world size 1 with fzero's own CPU kernel for AdamW on FP32 moments
    (``fused.adamw``; ``native_fused`` decides): one pass that reads the grads where they lie
    (the flat buffer, or the grad leaves), updates master and moments in place and casts the
    params into ``out``, their own buffer (``donate``; a skipped step writes nothing: the params
    are the master's cast already; compiled from a grads pytree, their buffer as ``[S, 1]``).
    ``cast=False``: FP32 params that are the master itself (``master="params"``), written as the
    master is. Pure (eager): the same on copies of master and moments, the params into a new
    buffer (a skipped step: the master's cast). The same bits as ``generic_whole`` compiled."""
    # ``fused.state`` is the new state, its moments the tensors the kernel writes: one traversal
    # of it (traced, fzero's walk: docs/startup.md).
    new_state = fused.state
    sized = [x for x in tree_leaves(new_state) if x.ndim]
    if not donate:
        master, sized = master.clone(), [x.clone() for x in sized]
        out = torch.empty(master.shape, dtype=param_dtype, device=master.device)
        copies = iter(sized)
        new_state = tree_map(lambda x: next(copies) if x.ndim else x, new_state)
    g = grads.segments()
    torch.ops.fzero.adamw_update_(list(g.parts), list(g.starts), native.pack(fused.adamw()), grads.mean_factor, skip, master, *sized,
                                  out if cast or not donate else None, not donate)
    return master, new_state, out if cast or not donate else master


def native_fused(tx, tx_state, parts, numel: int, skip, norm, param_dtype) -> FusedStep | None:
    """The transform's ``FusedStep`` where fzero's own CPU kernel can run it (``native_update``),
    else ``None``: AdamW's coefficients given for the grads as they are (no clipping before it),
    two ``[numel]`` FP32 moments, the grads ``parts`` FP16, BF16 or FP32 contiguous CPU pieces,
    FP16, BF16 or FP32 params."""
    if tx.fused is None or param_dtype not in _NATIVE_DTYPES or not _reads(parts):
        return None
    sized = [x for x in tree_leaves(tx_state) if x.ndim]
    if len(sized) != 2 or any(x.dtype != torch.float32 or x.shape != (numel,) for x in sized):
        return None
    one = torch.ones((), dtype=torch.float32, device=sized[0].device)
    fused = tx.fused(tx_state, grad_scale=one, found_inf=skip, grad_norm=norm)
    return fused if fused is not None and fused.adamw is not None and fused.grad_scale is one else None


def native_runs(tx, tx_state: Any, numel: int, param_dtype: torch.dtype) -> bool:
    """Whether fzero's own CPU kernel runs the update of ``tx`` on ``tx_state`` of ``[numel]``
    tensors for params and grads of ``param_dtype``: ``native_fused`` asked once, at ``init``,
    with a grad of that dtype (it decides from the transform and the state's dtypes and shapes,
    not from values)."""
    probe = [torch.zeros(1, dtype=param_dtype)]
    skip, norm = torch.zeros((), dtype=torch.bool), torch.ones((), dtype=torch.float64)
    return native_fused(tx, tx_state, probe, numel, skip, norm, param_dtype) is not None


class Native(NamedTuple):
    """``native_update`` where ``native_fused`` allows it at this step's values, else
    ``fallback``. ``check``: leaf by leaf into the params' own buffer (traced), the leaves are
    checked to be views of it first, and everything the step writes depends on ``skip``, so
    comes after."""

    param_dtype: torch.dtype
    donate: bool
    fallback: Any
    target: Any = NewTensor()
    check: IntoLeaves | None = None

    def run(self, tx, grads, master, tx_state, skip, norm):
        if self.check is not None:
            skip = skip | torch.ops.fzero.views_checked(*self.check)
        g = grads.segments()
        fused = native_fused(tx, tx_state, g.parts, g.numel, skip, norm, self.param_dtype)
        if fused is None:
            return self.fallback.run(tx, grads, master, tx_state, skip, norm)
        return native_update(tx, fused, grads, master, tx_state, skip, norm, param_dtype=self.param_dtype, chunk=None,
                             donate=self.donate, out=self.target.out(master), cast=self.target.casts)


def native_sum_of_squares(g: Segments, *, bounded: bool, compiled: bool = False) -> torch.Tensor:
    """``fzero.norm.sum_of_squares``'s eager rows, each row's sum of squares taken in one pass
    by fzero's kernel in FP32 (``bounded``) or float64, with no FP32 or float64 copy of the grads;
    traced too (``compiled``: where the step's update runs that kernel leaf by leaf, built), the
    eager step's bits. Where the kernel is not built, or the grads are not contiguous FP16, BF16
    or FP32 CPU pieces: ``fzero.norm.sum_of_squares``."""
    if (compiled or native.available(torch.device("cpu"))) and _reads(g.parts):
        return native.sum_of_squares(g.pieces(NORM_BLOCK), NORM_ROW, wide=not bounded)
    return sum_of_squares(g, bounded=bounded, compiled=compiled)


class NativeNorm(NamedTuple):
    """The norm's sum of squares on fzero's kernel (``native_sum_of_squares``): eager, CPU grads
    (built at its first call); or traced, where the kernel runs the update leaf by leaf."""

    compiled: bool = False

    def __call__(self, g: Segments, *, bounded: bool) -> torch.Tensor:
        return native_sum_of_squares(g, bounded=bounded, compiled=self.compiled)
