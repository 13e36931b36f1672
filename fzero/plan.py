"""How one step runs, as a value: what the engine has (``Kernels``, fixed at ``init``) and the
plan each step chooses from it (``StepPlan``, ``choose``), the one place that asks whether
``torch.compile`` is tracing. The stages read the plan and ask nothing again; the one decision
left to the update is the transform declining its fused form (or fzero's kernel) at this step's
values, where the variant runs the fallback the plan gave it.

docs/design.md has the table configuration -> plan; ``tests/test_plan.py`` holds the chooser to it.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import update
from .binding import Binding
from .cast import IntoBuffer, IntoLeaves, IntoMaster, NewTensor
from .cpu import chunked, kernel, leafwise, native
from .gather import GatherInto, GatherLaunched, GatherNew, NoGather
from .layout import Layout
from .tracing import compiling
from .norm import RowNorm
from .params_form import ParamsForm
from .storage import FP32Master, ParamsMaster, RemainderMaster
from .update import CompiledUpdate

__all__ = ["Kernels", "StepPlan", "choose", "kernels", "tracing"]

# The moments' dtypes below FP32 (BF16 or 8-bit), not a decay mask's bool
_LOW_PRECISION = (torch.bfloat16, torch.int8, torch.uint8)


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing the caller: for the step (``choose``) and the
    engine's host-side checks, asked here alone."""
    return compiling()


class Kernels(NamedTuple):
    """What an engine has, fixed at its first ``init``.

    ``param_dtype``, ``donate``, ``world_size``, ``numel`` (S, the shard's elements),
    ``state_device``: as bound. ``chunk``: on a CPU state device, the eager update runs in chunks
    of this many elements (``None``: the whole shard). ``fused``: the transform has a fused form;
    ``needs_context``: it takes the whole shard (never chunks); ``low_precision``: its state holds
    ``[S]`` tensors below FP32 (BF16 or 8-bit moments). ``master_in_params``: the storage takes
    the FP32 params' own shard as the master, the state where the params are; ``reads_params``:
    the storage rebuilds the master from the params. ``compiled``: the engine's compiled updates
    (``fzero.update.compiled_update``); ``native``: fzero's CPU kernel is built and may run the
    update (world size 1, a transform with a fused form); ``native_leaves``: it takes the
    transform leaf by leaf (donated); ``native_norm``: the grads are on a CPU, where the eager
    norm may run the kernel; ``leaves``: the compiled update leaf by leaf
    (``fzero.cpu.leafwise.LeafUpdate``), where a compiled step from a params pytree takes it;
    ``overlap_gather``: an eager step leaves the params' all-gather in flight (``fzero.arriving``)."""

    param_dtype: torch.dtype
    donate: bool
    world_size: int
    numel: int
    state_device: torch.device
    chunk: int | None
    fused: bool
    needs_context: bool
    low_precision: bool
    master_in_params: bool
    reads_params: bool
    compiled: CompiledUpdate
    native: bool = False
    native_leaves: bool = False
    native_norm: bool = False
    overlap_gather: bool = False
    leaves: Any = None


def kernels(tx, shard_tx, tx_state: Any, storage, bound: Binding, *, world_size: int, donate: bool,
            chunk_numel: int | None, overlap_gather: bool = False) -> Kernels:
    """The ``Kernels`` of an engine bound to ``bound``: ``tx`` as given, ``shard_tx`` as the step
    runs it on the shard, ``tx_state`` its fresh state, ``storage`` the master's
    (``fzero.storage``). Builds fzero's CPU kernel where a step may run it (once per machine)."""
    path, state_device = bound.grads, bound.state_device
    S, param_dtype = path.layout.shard_numel, path.param_dtype
    low = any(shape == (S,) and dtype in _LOW_PRECISION for _, shape, dtype in bound.tx_leaves)
    k = Kernels(param_dtype=param_dtype, donate=donate, world_size=world_size, numel=S, state_device=state_device,
                chunk=chunk_numel if state_device.type == "cpu" else None, fused=tx.fused is not None,
                needs_context=shard_tx.needs_context, low_precision=low,
                master_in_params=isinstance(storage, ParamsMaster) and state_device == path.device,
                reads_params=storage.reads_params, compiled=update.compiled_update(), overlap_gather=overlap_gather)
    use_native = k.fused and world_size == 1 and native.available(state_device)
    # donated only: the pure step's update leaf by leaf runs inductor's loops (fzero.cpu.leafwise)
    native_leaves = donate and use_native and kernel.native_runs(shard_tx, tx_state, S, param_dtype)
    k = k._replace(native=use_native, native_leaves=native_leaves, native_norm=path.device.type == "cpu")
    if _leafwise(tx, storage, bound, world_size, native=native_leaves):
        sized = tuple(len(shape) == 1 for _, shape, _ in bound.tx_leaves)
        k = k._replace(leaves=leafwise.LeafUpdate(shard_tx, bound.tx_spec, sized, param_dtype))
    return k


def _leafwise(tx, storage, b: Binding, world_size: int, *, native: bool) -> bool:
    """Whether a compiled step from a params pytree may run its update leaf by leaf
    (``fzero.cpu.leafwise``): on a CPU, for a model and leaves large enough
    (``leafwise.worthwhile``; ``native``: fzero's own CPU kernel would run it, where the
    leaves' count costs nothing and the model's size alone decides), at world size 1, the
    state where the params are, an FP32 master beside FP16 or BF16 params (with the kernel
    also FP32 params, beside their master or, ``master="params"``, as it), a transform
    elementwise on any slice (no blocks, no context) whose state is ``[S]`` and 0-d tensors.

    What it saves is a CPU's cost (the grads' concatenation, a copy inductor's CPU code never
    fuses, and new shard-sized buffers, fresh pages from the OS every step); what it costs is
    host time per leaf, which small leaves or a small model do not repay (the measurements
    behind ``leafwise.MIN_MEAN_NUMEL``, ``MIN_NUMEL`` and ``NATIVE_MIN_NUMEL``), nor a GPU's
    kernels hide at a model's size (docs/performance.md)."""
    layout, device = b.grads.layout, b.grads.device
    S, param_dtype = layout.shard_numel, b.grads.param_dtype
    return (device.type == "cpu" and leafwise.worthwhile(layout.numel, len(layout.shapes), native=native)
            and world_size == 1 and b.state_device == device
            and not isinstance(storage, RemainderMaster)
            and (native or isinstance(storage, FP32Master) and param_dtype != torch.float32)
            and tx.block == 1
            and not tx.needs_context and all(shape in ((S,), ()) for _, shape, _ in b.tx_leaves))


class StepPlan(NamedTuple):
    """One step's path. ``compiled``: traced by ``torch.compile`` (host-side checks that cannot
    be traced are left out); ``donate``: results go into the inputs' buffers; ``state_device``:
    where master and transform state live (the update runs there); ``segments``: the grads are
    read as ``Segments``, where they lie (at world size 1 the grad leaves); ``norm``: the norm's
    sum of squares (``fzero.norm.RowNorm`` or ``fzero.cpu.kernel.NativeNorm``); ``update``: the
    update's variant (``run``); ``cast``: where it casts the params shard (``fzero.cast``);
    ``gather``: how the new params are gathered (``fzero.gather``); ``params``: the params' form
    (``fzero.params_form.ParamsForm``) as the step uses it -- leaf by leaf into their own buffer,
    traced, its ``buffer`` is the one ``IntoLeaves`` writes."""

    compiled: bool
    donate: bool
    state_device: torch.device
    segments: bool
    norm: Any
    update: Any
    cast: Any
    gather: Any
    params: ParamsForm

    @property
    def flat_in(self) -> bool:
        """The params came as the flat ``[N*S]`` buffer."""
        return self.params.flat_in


def choose(k: Kernels, params: ParamsForm, layout: Layout, *, compiled: bool) -> StepPlan:
    """The plan of a step of an engine with ``k``, on ``params`` (the door's form, built where
    ``compiled`` -- whether ``torch.compile`` traces the step, ``tracing()`` -- was asked), laid
    out as ``layout``."""
    flat_in = params.flat_in
    whole_buffer = k.world_size == 1  # the shard is the whole buffer
    fused = k.fused and not compiled
    leaves = compiled and not flat_in and whole_buffer and k.leaves is not None
    # fzero's CPU kernel, where the update is the whole buffer: compiled and donated, on the flat
    # buffer or leaf by leaf (in place; into new tensors inductor's loops are faster); eager, the
    # fused step, donated or pure (on copies)
    use_native = k.native and whole_buffer and ((compiled and k.donate and (flat_in or leaves and k.native_leaves))
                                                 or fused)
    into_params = (fused or leaves or use_native) and k.donate and whole_buffer
    # Donated, the gathered params are written into the given ones; not for FP16/BF16 leaves of a
    # compiled pytree, where inductor would keep the new FP32 master in a shard-sized temporary to
    # cast each leaf from (a new buffer is cheaper, docs/performance.md); FP32 params are the
    # master itself.
    write_params = k.donate and (flat_in or not compiled or k.param_dtype == torch.float32)
    gather_into = write_params and not whole_buffer
    params_are_master = k.master_in_params and into_params

    into_leaves = None
    if leaves and into_params:
        # traced, where storages and offsets cannot be read: the buffer as the first leaf's memory
        # from its start, which the update checks the leaves are views of before it writes
        into_leaves = IntoLeaves(params.leaves[0].as_strided((layout.padded_numel, 1), (1, 1), 0),
                                 params.leaves, list(layout.offsets))
        params = params._replace(buffer=into_leaves.buffer)
    buffer = params.buffer
    if params_are_master:
        cast = IntoMaster(into_leaves)
    elif into_leaves is not None:
        cast = into_leaves
    else:
        cast = IntoBuffer(buffer) if into_params and buffer is not None else NewTensor()

    if cast.into_params:
        gather = NoGather()
    elif k.overlap_gather and not compiled and not whole_buffer:  # handed out in flight (into the params' own buffer, donated)
        gather = GatherLaunched(buffer if gather_into else None)
    else:
        gather = GatherInto(buffer) if gather_into and buffer is not None else GatherNew(write_params)

    chunk = None if compiled else k.chunk
    variant = _update(k, cast, compiled=compiled, fused=fused, chunk=chunk)
    if leaves:
        variant = leafwise.CompiledLeaves(k.leaves, into_leaves)
    if use_native:
        variant = kernel.Native(k.param_dtype, k.donate, variant, cast, into_leaves)
    # traced, the kernel's norm where it runs the update leaf by leaf (one call over the grad
    # leaves, not a reduction per leaf in the graph)
    native_norm = k.native_norm and (not compiled or use_native and leaves)
    norm = kernel.NativeNorm(compiled) if native_norm else RowNorm(compiled)
    return StepPlan(compiled, k.donate, k.state_device, fused or leaves, norm, variant, cast, gather, params)


def _update(k: Kernels, cast, *, compiled: bool, fused: bool, chunk: int | None):
    """The update's variant where neither fzero's kernel nor the leaf-by-leaf op runs: compiled,
    on the whole shard (inductor fuses it); eager, the transform's fused form where it has one
    (chunk by chunk on a CPU), else ``tx.update`` chunk by chunk, compiled for BF16 or 8-bit state
    on a shard of at least ``update.COMPILE_NUMEL`` elements (below that, compiling costs more
    than it saves); a transform that ``needs_context`` takes the whole shard (compiled on such a
    CPU shard) and never its fused form."""
    pd, donate = k.param_dtype, k.donate
    if compiled:
        return update.Whole(pd, donate, cast, traced=True)
    compile_it = chunk is not None and k.numel >= update.COMPILE_NUMEL
    if k.needs_context:
        return update.CompiledWhole(pd, donate, k.compiled, cast) if compile_it else update.Whole(pd, donate, cast)
    if chunk is None or chunk >= k.numel:
        generic = update.Whole(pd, donate, cast)
    elif compile_it and k.low_precision:
        generic = chunked.CompiledChunks(pd, donate, chunk, k.compiled, cast)
    else:
        generic = chunked.Chunks(pd, donate, chunk, cast)
    if not fused:
        return generic
    if chunk is None:
        return update.Fused(pd, donate, k.state_device, generic, cast)
    return chunked.FusedChunks(pd, donate, chunk, k.state_device, generic, cast)
