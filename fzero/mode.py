"""How one step runs: every decision that depends on the configuration, the world size, the
params' form and whether ``torch.compile`` is tracing, made once per call, in one place.

``StepMode.choose`` is built at the top of ``Engine.step`` and passed down; the stages read its
fields and ask nothing again. The one decision left to the update stage is whether the fused
kernel runs, since a transform may decline it for the step's values (``fzero.update.choose``).
"""
from __future__ import annotations

import dataclasses

import torch

__all__ = ["StepMode", "compiling"]


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing the caller: the one place fzero asks."""
    return torch.compiler.is_compiling()


@dataclasses.dataclass(frozen=True)
class StepMode:
    """The decisions of one step.

    ``compiled``: traced by ``torch.compile`` (inductor fuses the update on the whole shard,
    host-side checks that cannot be traced are left out). ``fused``: eager with a transform
    that has a fused form: torch's kernel is tried, and the grads are read as ``Segments``,
    chunk by chunk (at world size 1 the caller's grad leaves). ``chunk``: eager on a CPU
    shard (CPU training or ``offload``), the update runs in chunks of this many elements
    (``None``: the whole shard at once). ``state_device``: where master and transform state
    live (the host with ``offload``): the update runs there. ``flat_in``: the params were
    given as the flat buffer. ``donate``: results go into the inputs' buffers.
    ``cast_into_params``: fused, ``leafwise`` or ``native``, donated, at world size 1 the params shard is
    the whole buffer: the update casts straight into the params' own buffer and there is
    nothing to gather. ``write_params``: donated, the gathered params are written into the given ones;
    not for FP16/BF16 leaves of a compiled pytree, where inductor would keep the new FP32
    master in a shard-sized temporary to cast each leaf from (cheaper: a new buffer, see
    docs/performance.md); FP32 params are the master itself. ``own_buffer``: the params' own
    flat buffer may be looked up (it is the input, or eager: compiled, a pytree's leaves are
    laid out instead). ``leafwise``: compiled from a params pytree at world size 1 on a CPU, for
    leaves large enough and a transform and master storage that allow it (the engine's
    ``_leafwise``, ``fzero.leafwise``): the update runs leaf by leaf in one opaque op, reading
    the grads as ``Segments`` (the leaves as they are); donated, it casts into the params' own
    buffer. ``native``: at world size 1, compiled and donated on the flat buffer or leaf by leaf,
    or eager with a fused form, where the engine has fzero's own CPU kernel (``fzero.native``):
    the update may run it (``fzero.update.native_fused`` decides from the transform and the
    grads; leaf by leaf, where the engine found at ``init`` that it takes the transform,
    ``native_leaves``, it reads the grad leaves where they lie). ``native_norm``:
    eager, the grads on a CPU: the sum of squares runs that kernel where it can be built; and
    traced where the kernel runs the update leaf by leaf (one call over the grad leaves).
    ``params_are_master``: FP32 params whose own shard is the master (``master="params"``, the
    state where the params are: ``master_in_params``), and the update writes into their own
    buffer (``cast_into_params``): it writes them as it writes the master, there is nothing to
    cast."""

    compiled: bool
    fused: bool
    chunk: int | None
    state_device: torch.device
    flat_in: bool
    donate: bool
    cast_into_params: bool
    write_params: bool
    own_buffer: bool
    leafwise: bool
    native: bool
    native_norm: bool
    params_are_master: bool

    @classmethod
    def choose(cls, *, has_fused: bool, donate: bool, chunk_numel: int | None, param_dtype: torch.dtype,
               world_size: int, state_device: torch.device, flat_in: bool, leafwise: bool,
               native: bool, native_leaves: bool, native_norm: bool, master_in_params: bool) -> "StepMode":
        compiled = compiling()
        fused = has_fused and not compiled
        leafwise = compiled and not flat_in and world_size == 1 and leafwise
        # fzero's CPU kernel, at world size 1, where the update is the whole buffer: compiled and
        # donated, on the flat buffer or leaf by leaf (in place; into new tensors inductor's loops
        # are faster); eager, the fused step, donated or pure (on copies)
        native = native and world_size == 1 and ((compiled and donate and (flat_in or leafwise and native_leaves))
                                                 or fused)
        cast_into_params = (fused or leafwise or native) and donate and world_size == 1
        return cls(
            compiled=compiled,
            fused=fused,
            chunk=chunk_numel if state_device.type == "cpu" and not compiled else None,
            state_device=state_device,
            flat_in=flat_in,
            donate=donate,
            cast_into_params=cast_into_params,
            write_params=donate and (flat_in or not compiled or param_dtype == torch.float32),
            own_buffer=flat_in or not compiled,
            leafwise=leafwise,
            native=native,
            # traced, where the kernel runs the update leaf by leaf (``native_leaves``: the engine
            # built it): one call over the grad leaves, not a reduction per leaf in the graph
            native_norm=native_norm and (not compiled or native and leafwise),
            params_are_master=master_in_params and cast_into_params,
        )
