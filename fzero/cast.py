"""The params from the FP32 master: the saturating cast, where the update casts them (the step
plan's cast target), and the copy of a step's results into the inputs' own buffers (``donate``)."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .flat import tree_leaves
from .remainder import round_bf16

__all__ = ["cast_params", "write_into", "NewTensor", "IntoBuffer", "IntoLeaves", "IntoMaster"]


def cast_params(master: torch.Tensor, dtype: torch.dtype, *, copy: bool = False,
                out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 master values in the param ``dtype``, *saturating*: values beyond the dtype's
    finite range (65504 for FP16) become its largest finite value instead of inf, so a finite
    master never gives a non-finite param. The master keeps the exact value; NaN stays NaN.
    ``copy``: a new tensor even when ``dtype`` is FP32; ``out``: written into that tensor
    (of ``dtype``, like ``master``) and returned; ``scratch``: an FP32 tensor like ``master``
    that may be overwritten, where the saturation then runs before the cast (the same bits:
    the largest finite value rounds to itself, and whatever lies beyond it rounds to it or to
    inf), because a CPU clamps FP32 faster than FP16 or BF16 (the eager step's chunks,
    ``fzero.cpu.chunked.fused_chunks``)."""
    if dtype == master.dtype:
        return out.copy_(master) if out is not None else master.clone() if copy else master
    big = torch.finfo(dtype).max
    if scratch is not None:
        master = torch.clamp(master, -big, big, out=scratch)
    # BF16: to nearest, ties away from zero, the rounding under which (BF16, int16 remainder)
    # splits the FP32 master exactly (fzero.remainder); FP16: torch's cast (ties to even).
    rounded = round_bf16(master) if dtype == torch.bfloat16 else master
    cast = rounded.to(dtype) if out is None else out.copy_(rounded)
    return cast if scratch is not None else cast.clamp_(-big, big)  # +-inf -> +-max; NaN stays NaN


def write_into(old: Any, new: Any) -> Any:
    """Copy every tensor of ``new`` into the matching tensor of ``old`` (pytrees, or lists of
    leaves); return ``old``.

    Under ``torch.compile`` inductor stores the step's results straight into the input
    buffers, so the FP32 state is never held twice."""
    for o, n in zip(tree_leaves(old), tree_leaves(new)):
        if o is not n:  # updated in place already (the fused kernel)
            o.copy_(n)
    return old


# Where the update casts the params shard (``StepPlan.cast``). ``out(master)``: the tensor to cast
# into, ``None`` for a new one; ``casts``: whether there is anything to cast; ``into_params``: the
# update writes the params themselves (nothing is gathered after).


class NewTensor(NamedTuple):
    """A new ``[S]`` tensor of the param dtype."""

    casts = True
    into_params = False

    def out(self, master: torch.Tensor) -> None:
        return None


class IntoBuffer(NamedTuple):
    """``buffer``: the params' own flat buffer (donated, at world size 1 the whole shard)."""

    buffer: torch.Tensor
    casts = True
    into_params = True

    def out(self, master: torch.Tensor) -> torch.Tensor:
        return self.buffer


class IntoLeaves(NamedTuple):
    """The params' own buffer as a traced step from a params pytree sees it (storages and offsets
    cannot be read there): ``buffer``, the ``[padded_numel, 1]`` view of the first leaf's memory
    from its start, which the param ``leaves`` must be views of at ``offsets``; the update checks
    that, eagerly, before it writes (``fzero.memory.check_in_buffer``). 2-D: functionalization
    would take a 1-D view of that shape for a slice of a 1-D first leaf, and regenerate it
    clamped to it."""

    buffer: torch.Tensor
    leaves: list
    offsets: list
    casts = True
    into_params = True

    def out(self, master: torch.Tensor) -> torch.Tensor:
        return self.buffer


class IntoMaster(NamedTuple):
    """FP32 params whose own shard is the master (``master="params"``): the update writes them
    as it writes the master; nothing is cast. ``leaves``: the ``IntoLeaves`` a traced step from a
    params pytree checks first, else ``None``."""

    leaves: IntoLeaves | None = None
    casts = False
    into_params = True

    def out(self, master: torch.Tensor) -> torch.Tensor:
        return master
