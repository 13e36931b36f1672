"""The stages of ``Engine.step``, each a function of the step's inputs and its ``StepMode``:
reduce -> norm and overflow -> update -> gather (the loss scale then updates itself, see
``fzero.scaler``).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from .flat import Layout, flat_buffer, flatten, leaf_views, shard_of, unflatten
from .grads import GradPath, Reduced
from .mode import StepMode
from .update import ShardGrads, choose, sum_of_squares, write_into

__all__ = ["Checked", "reduce", "norm_and_overflow", "update", "gather", "own_buffer", "cast_target", "params_shard"]


def reduce(path: GradPath, grads: Any, mode: StepMode) -> Reduced:
    """This rank's ``[S]`` shard of the grads over ranks; ``shard * factor`` is their mean (the
    user's grads take one of two forms at the door, see ``fzero.grads``). Fused, the shard is
    read as ``Segments``, chunk by chunk: at world size 1 the grad leaves (also for the
    compiled update leaf by leaf, ``mode.leafwise``)."""
    return path.reduce(path.to_form(grads, segments=mode.fused or mode.leafwise, donated=mode.donate))


class Checked(NamedTuple):
    """The step's grads and what the one small all-reduce found: ``found_inf`` (0-d bool, the
    same on every rank), ``norm`` (0-d float64 global norm of the mean unscaled grads, NaN on
    any overflow), ``skip`` (0-d bool: an overflow, or a non-finite value in ``rates``) and
    ``rates``, the transform's values at this step that are not stored (a schedule's lr)."""

    grads: ShardGrads
    found_inf: torch.Tensor
    norm: torch.Tensor
    skip: torch.Tensor
    rates: dict


def norm_and_overflow(path: GradPath, reduced: Reduced, scale: torch.Tensor, tx, tx_state: Any,
                      mode: StepMode) -> Checked:
    """One small all-reduce: the global sum of squares of the mean unscaled grads, which are
    shard / grad_scale, summed from the shard as it came, scaled (in FP32 for FP16 grads: it
    cannot overflow, see ``fzero.update.sum_of_squares``). Any inf/NaN on any rank makes it
    non-finite, so it doubles as the cross-rank found_inf agreement. Padding is zero."""
    grads = ShardGrads.of(reduced, scale)
    bounded = path.param_dtype == torch.float16
    sumsq = sum_of_squares(grads.segments(), bounded=bounded, compiled=mode.compiled, native=mode.native_norm)
    sumsq = sumsq / grads.grad_scale.double().square()
    sumsq = path.comm.all_reduce_sum(sumsq)
    found_inf = ~torch.isfinite(sumsq)
    # One NaN for every overflow: a NaN's sign and payload come from whichever operand the
    # kernels met first, which changes with the fusion of the compiled graph around it.
    norm = torch.where(torch.isnan(sumsq), torch.nan, torch.sqrt(sumsq))
    # The same on every rank; a non-finite one skips the update like an overflow (the loss
    # scale stays).
    rates = tx.hyperparams(tx_state) if tx.hyperparams else {}
    skip = found_inf
    for v in rates.values():
        skip = skip | ~torch.isfinite(v)
    return Checked(grads, found_inf, norm, skip, rates)


def update(tx, checked: Checked, master: torch.Tensor, tx_state: Any, *, param_dtype: torch.dtype, mode: StepMode,
           out: torch.Tensor | None, compiled):
    """Transform, skip if not finite, cast: ``(master, tx_state, params shard)`` on the FP32
    shard where the state lives (the host with offload: a blocking copy of the grads there),
    with the variant ``fzero.update.choose`` picks for this step. ``out``: the params' own
    buffer to cast into (``mode.cast_into_params``), else ``None``; ``compiled``: the engine's
    ``fzero.update.compiled_update()``, for a compiled variant."""
    skip, norm = checked.skip.to(mode.state_device), checked.norm.to(mode.state_device)
    if mode.native and isinstance(out, tuple):
        # leaf by leaf, the kernel would cast into the params' buffer: the leaves are checked to be
        # views of it first, and everything the step writes depends on ``skip``, so comes after
        skip = skip | torch.ops.fzero.views_checked(*out)
    if mode.params_are_master:  # the master is a view of the params' own buffer: written, nothing cast
        out = master
    variant, fused = choose(mode, tx, tx_state, checked.grads, skip, norm, master.numel(), param_dtype=param_dtype)
    return variant(tx, fused, checked.grads, master, tx_state, skip, norm, param_dtype=param_dtype, chunk=mode.chunk,
                   donate=mode.donate, out=out, compiled=compiled)


def gather(path: GradPath, shard: torch.Tensor, params: Any, mode: StepMode, cast_into_params: bool) -> Any:
    """Everyone's cast shard gathered into the new flat param buffer, as ``params`` came (flat
    or a pytree); with ``mode.write_params``, into the params' own buffer when there is one
    (no new buffer), else written into ``params`` after. ``cast_into_params``: the update cast
    into the params' own buffer at world size 1: they are the new params."""
    if cast_into_params:
        return params
    shard = shard.to(path.device, non_blocking=True)
    # looked up only where it is used: at world size 1 the shard is the whole buffer already
    gather_into = mode.write_params and mode.own_buffer and path.comm.world_size > 1
    into = own_buffer(params, path.layout, mode.flat_in) if gather_into else None
    if into is not None:
        path.comm.all_gather_into(into, shard, path.layout)
        return params
    new_params = path.comm.all_gather(shard, path.layout)
    if mode.flat_in:
        return write_into(params, new_params) if mode.write_params else new_params
    if mode.write_params:  # view by view into the leaves: no tree built, then walked again
        write_into(optree.tree_leaves(params), leaf_views(new_params, path.layout))
        return params
    return unflatten(new_params, path.layout, like=params)


def own_buffer(params: Any, layout: Layout, flat_in: bool) -> torch.Tensor | None:
    """The flat buffer ``params`` are (views of), or ``None`` if they are not (then the step
    writes a new one and copies it into ``params``)."""
    if flat_in:
        return params
    try:
        return flat_buffer(optree.tree_leaves(params), layout)
    except ValueError:
        return None


def cast_target(params: Any, layout: Layout, mode: StepMode) -> torch.Tensor | tuple | None:
    """Where the update casts the params shard: the params' own buffer with
    ``mode.cast_into_params`` (if they are views of one), else ``None`` (a new tensor).

    With ``mode.leafwise`` and ``mode.cast_into_params`` (traced, where storages and offsets
    cannot be read): ``(buffer, leaves, offsets)``, the buffer the params init and step return
    are views of (at the layout's offsets) as the ``[padded_numel, 1]`` view of the first leaf's
    memory from its start, with the leaves and those offsets; the update checks them, eagerly,
    before it writes (``fzero.flat.check_in_buffer``). 2-D: functionalization would take a
    1-D view of that shape for a slice of a 1-D first leaf, and regenerate it clamped to it."""
    if not mode.cast_into_params:
        return None
    if mode.leafwise:
        leaves = optree.tree_leaves(params)
        return leaves[0].as_strided((layout.padded_numel, 1), (1, 1), 0), leaves, list(layout.offsets)
    return own_buffer(params, layout, mode.flat_in)


def params_shard(params: Any, layout: Layout, rank: int, mode: StepMode) -> torch.Tensor:
    """This rank's ``[S]`` shard of the params' flat buffer: a view of their own buffer where
    ``mode.own_buffer`` allows looking it up and they are views of one, else laid out anew;
    leaf by leaf into their own buffer (traced), that buffer as ``cast_target`` takes it,
    ``[S, 1]`` (the update checks the leaves are views of it before it reads or writes it)."""
    if mode.leafwise and mode.cast_into_params:
        return cast_target(params, layout, mode)[0]
    flat = own_buffer(params, layout, mode.flat_in) if mode.own_buffer else None
    return shard_of(flatten(params, layout) if flat is None else flat, layout, rank)
