"""The update on this rank's FP32 shard: transform -> keep the old values where the step is
skipped -> cast to the param dtype; the general variants of it, and the engine's compiled forms.

The transforms are elementwise on the shard (a rank holds arbitrary slices of params, so they
must be; the one global quantity, the grad norm, comes in as an argument). The variants here run
on the whole shard: compiled, inductor fuses the update into one loop; eager on a GPU, each op is
one kernel over the shard. A CPU's eager update runs in cache-sized chunks and fzero's own kernel
(``fzero.cpu``). ``fzero.plan`` picks one variant per step.

Each variant (like torch.optim's ``_fused_adamw`` / ``_multi_tensor_adamw`` /
``_single_tensor_adamw``) is a function of one signature, ``(tx, fused, grads, master, tx_state,
skip, norm, *, param_dtype, chunk, donate, out, compiled) -> (master, tx_state, params shard)``,
and a small class whose ``run(tx, grads, master, tx_state, skip, norm)`` calls it with what the
plan fixed. ``fused``: the ``FusedStep`` the transform gave for this step (else ``None``);
``grads``: ``ShardGrads``; ``skip`` 0-d bool (keep every old value); ``norm`` the global grad norm
(float64, for clipping); ``chunk``: elements per chunk (``None``: the whole shard); ``donate``:
write into the inputs' own buffers (else new ones: the step stays pure); ``out``: an ``[S]``
``param_dtype`` tensor to cast the params shard into (else a new one); ``compiled``: the engine's
``compiled_update()``. Results do not depend on the chunking, and the fused and generic variants
agree to float rounding.
"""
from __future__ import annotations

import types
from typing import Any, NamedTuple

import torch
from torch.utils import _python_dispatch

from fzero.transforms import FusedStep, scalar

from .blocks import is_shard
from .cast import NewTensor, cast_params
from .flat import tree_leaves, tree_map
from .grad_forms import Reduced, Segments

__all__ = ["ShardGrads", "CompiledUpdate", "compiled_update", "own_compile", "update_into", "COMPILE_NUMEL",
           "generic_whole", "compiled_whole", "fused_whole", "fused_slice", "fused_inputs", "fused_state", "ask_fused", "run_fused",
           "Whole", "CompiledWhole", "Fused"]

COMPILE_NUMEL = 2**20  # eager shards from this size up compile their update when it has no fused kernel


class ShardGrads(NamedTuple):
    """This rank's reduced grads as the update reads them: ``shard * factor`` is the mean over
    ranks of the grads (summed over micro-batches) times ``scale`` (the loss scale);
    ``shard`` is the ``[S]`` tensor, or ``Segments`` of it (the eager fused step).
    ``owned``: ``shard`` is no caller's tensor. ``grad_scale`` (0-d FP32): what the grads are
    divided by to be the mean unscaled grads."""

    shard: torch.Tensor | Segments
    factor: float
    scale: torch.Tensor
    owned: bool
    grad_scale: torch.Tensor

    @classmethod
    def of(cls, reduced: Reduced, scale: torch.Tensor) -> "ShardGrads":
        grad_scale = scalar(scale / reduced.factor)
        return cls(reduced.shard, reduced.factor, scale, reduced.owned, grad_scale)

    def segments(self) -> Segments:
        return self.shard if isinstance(self.shard, Segments) else Segments.of(self.shard, self.owned)

    @property
    def mean_factor(self) -> torch.Tensor:
        """What ``shard`` is multiplied by to be the mean unscaled grads (0-d FP32)."""
        return scalar(self.factor / self.scale)

    def mean(self, device: torch.device, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """The FP32 mean unscaled grads ``[lo:hi]`` (default: all ``[S]``) on ``device``: one
        FP32 multiply; ``Segments`` (read for a fused kernel that declined) divided by
        ``grad_scale`` as the kernel would."""
        if isinstance(self.shard, Segments):
            hi = self.shard.numel if hi is None else hi
            return self.shard.fp32(lo, hi, device) / self.grad_scale.to(device)
        return (self.shard[lo:hi].float() * self.mean_factor).to(device)


def _update(tx, g, master, tx_state, skip, norm, param_dtype, *, traced=False):
    """The update of (a chunk of) the shard: ``(master, tx_state, master in param_dtype)``.
    ``traced``: by ``torch.compile`` (the compiled forms and the compiled step set it)."""
    updates, new_tx_state = tx.update(g, tx_state, master, grad_norm=norm)
    # Skip without a branch: on overflow every state tensor keeps its old bits.
    new_master = torch.where(skip, master, master + updates)
    new_tx_state = tree_map(lambda new, old: _keep_if(skip, old, new, traced), new_tx_state, tx_state)
    return new_master, new_tx_state, cast_params(new_master, param_dtype)


def update_into(tx, g, master, tx_state, skip, norm, param_dtype, outs, *, traced=False):
    """``_update`` of a chunk written into ``outs``, the chunk's slices of the full-size outputs
    ``(master, tx_state, params shard)`` (with ``donate``, the very tensors given as ``master``
    and ``tx_state``): returns the new state's 0-d leaves (``count``, ...), in order."""
    new = _update(tx, g, master, tx_state, skip, norm, param_dtype, traced=traced)
    scalars = []
    for o, n in zip(tree_leaves(outs), tree_leaves(new)):
        if o.ndim:
            o.copy_(n)
        else:
            scalars.append(n)
    return scalars


def _keep_if(skip: torch.Tensor, old: torch.Tensor, new: torch.Tensor, traced: bool) -> torch.Tensor:
    """``torch.where(skip, old, new)``. Traced, 1-byte tensors (8-bit moments' codes) are
    selected as FP32 values and cast back, the same bits (every int8 and uint8 value is an FP32
    one): inductor's CPU code blends 1-byte lanes under a bool mask converted lane by lane, many
    times the cost of the select in FP32, which also fuses into the loop that computes the codes
    (``benchmarks/moments.py``; the figures in docs/performance.md).

    A leaf the update returned as it was (a hyperparameter) is ``old`` itself: nothing to
    select, and nothing for a donated step to write back (``write_into``). Compiled, a copy
    into a 0-d float64 CPU input made the graph differ from the one torch traces again after
    its scalar pass restarts the trace, so the first graph's cache entry was never written and
    every warm process traced the step twice (docs/startup.md)."""
    if new is old:
        return old
    if traced and old.element_size() == 1:
        return torch.where(skip, old.float(), new.float()).to(old.dtype)
    return torch.where(skip, old, new)


class CompiledUpdate(NamedTuple):
    """An engine's compiled updates: ``whole`` is ``_update`` (``compiled_whole``), ``into`` is
    ``update_into`` (``fzero.cpu.chunked.compiled_chunks``)."""

    whole: Any
    into: Any


def _dynamo_runs_no_frame() -> bool:
    """Whether ``torch.compile`` runs nothing compiled here: under a ``TorchDispatchMode`` (a
    counter, a debugging mode), dynamo skips every frame (the predicate is dynamo's own)."""
    pd = _python_dispatch
    if hasattr(pd, "any_torch_dispatch_mode_on_stack"):  # torch >= 2.9
        if getattr(torch._dynamo.config, "inline_torch_dispatch_torch_compile", True):
            return pd.any_torch_dispatch_mode_on_stack()
        return pd.is_in_any_mode_without_ignore_compile_internals()
    return pd.is_in_torch_dispatch_mode(include_infra_modes=False)


def own_compile(fn, *, dynamic: bool = False, options: dict | None = None):
    """``fn`` under ``torch.compile`` (``dynamic``, inductor ``options``, ``traced=True``) with a
    compile cache of its own. Dynamo keeps compiled graphs, and its limit of recompiles (8), per
    code object, and a graph is guarded on the chunk's shape and on what the transform holds: one
    ``_update`` shared by every engine of a process failed (``fullgraph=True``) once their shards'
    shapes had made more graphs than that. A copy of the code object per engine keeps each
    engine's few graphs apart.

    Under a ``TorchDispatchMode`` dynamo compiles nothing (and ``fullgraph=True`` raises): there
    the same function runs eagerly, so that such a mode sees the step take its usual path."""
    code = fn.__code__.replace()  # a new code object, the same code
    own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = {**(fn.__kwdefaults__ or {}), "traced": True}
    compiled = torch.compile(own, fullgraph=True, dynamic=dynamic, options=options)
    return lambda *args, **kwargs: (own if _dynamo_runs_no_frame() else compiled)(*args, **kwargs)


def compiled_update() -> CompiledUpdate:
    """The compiled updates for ``compiled_chunks`` and ``compiled_whole``: each engine makes its
    own (nothing compiles before the first call)."""
    return CompiledUpdate(own_compile(_update), own_compile(update_into))


def generic_whole(tx, fused, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk, donate, out,
                  compiled=None, traced=False):
    """``tx.update`` on the whole shard at once (``traced``, the compiled step: inductor fuses it
    into one loop)."""
    update = lambda *a: _update(*a, traced=traced)  # noqa: E731
    return _whole(update, tx, grads, master, tx_state, skip, norm, param_dtype=param_dtype, out=out)


def _whole(update, tx, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, out):
    master, tx_state, shard = update(tx, grads.mean(master.device), master, tx_state, skip, norm, param_dtype)
    return master, tx_state, shard if out is None else out.copy_(shard)


def compiled_whole(tx, fused, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk, donate, out,
                   compiled):
    """``generic_whole`` with the update compiled, for a transform that takes the whole shard
    (``needs_context``: ``partition``, Muon) eager on a large CPU shard: the groups' gathers and
    the elementwise math fused into a few loops instead of one eager pass per op (the small
    GPT's Muon + AdamW step on 2 ranks, ``benchmarks/muon.py``: see docs/muon.md). Compiled once
    per engine (``compiled``), at the first step, as ``compiled_chunks`` is."""
    return _whole(compiled.whole, tx, grads, master, tx_state, skip, norm, param_dtype=param_dtype, out=out)


def fused_inputs(master: torch.Tensor, tx_state: Any, donate: bool) -> tuple[torch.Tensor, Any]:
    """What a fused kernel writes: ``master`` and ``tx_state`` themselves (``donate``), else
    copies of their floating ``[S]`` tensors (masks are only read)."""
    if donate:
        return master, tx_state
    S = master.numel()
    copy = lambda x: x.clone() if is_shard(x, S) and x.is_floating_point() else x  # noqa: E731
    return tree_map(copy, (master, tx_state))


def fused_state(tx_state: Any, fused: FusedStep, S: int) -> Any:
    """The new transform state after ``fused.kernel``: the ``[S]`` tensors it wrote, the 0-d
    leaves of the fused step's state."""
    return tree_map(lambda full, new: full if is_shard(full, S) else new, tx_state, fused.state)


def fused_whole(tx, fused: FusedStep, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk=None,
                donate, out, compiled=None, cast=True):
    """torch's fused kernel (one pass over master, grads and moments) on the whole shard, in place
    on ``master`` and ``tx_state`` (or on copies of their ``[S]`` tensors), then the cast into
    ``out``; ``cast=False``: the master is the params (``master="params"``), written already."""
    S = master.numel()
    master, state = fused_inputs(master, tx_state, donate)
    out = torch.empty(S, dtype=param_dtype, device=master.device) if out is None else out
    fused_slice(fused, grads.segments(), 0, master, state, out, param_dtype, cast=cast)
    return master, fused_state(state, fused, S), out


def fused_slice(fused: FusedStep, g: Segments, lo: int, master: torch.Tensor, state: Any, out: torch.Tensor,
                param_dtype: torch.dtype, *, cast: bool, saturate_in_grads: bool = False) -> None:
    """``fused.kernel`` on ``master``, the shard's elements from ``lo`` (and ``state``, its slice
    of the transform state), with the FP32 grads of those elements read from ``g``; then, with
    ``cast``, ``master`` cast into ``out``, its slice of the params shard (``saturate_in_grads``:
    the spent FP32 grads are the cast's ``scratch``)."""
    grads = g.fp32(lo, lo + master.numel(), master.device)
    fused.kernel(master, grads, state)
    if cast:
        cast_params(master, param_dtype, out=out, scratch=grads if saturate_in_grads else None)


class Whole(NamedTuple):
    """``generic_whole``; ``traced``: the compiled step."""

    param_dtype: torch.dtype
    donate: bool
    target: Any = NewTensor()
    traced: bool = False

    def run(self, tx, grads, master, tx_state, skip, norm):
        return generic_whole(tx, None, grads, master, tx_state, skip, norm, param_dtype=self.param_dtype, chunk=None,
                             donate=self.donate, out=self.target.out(master), traced=self.traced)


class CompiledWhole(NamedTuple):
    """``compiled_whole`` with the engine's ``compiled`` updates."""

    param_dtype: torch.dtype
    donate: bool
    compiled: CompiledUpdate
    target: Any = NewTensor()

    def run(self, tx, grads, master, tx_state, skip, norm):
        return compiled_whole(tx, None, grads, master, tx_state, skip, norm, param_dtype=self.param_dtype, chunk=None,
                              donate=self.donate, out=self.target.out(master), compiled=self.compiled)


class Fused(NamedTuple):
    """``fused_whole`` with the transform's ``FusedStep`` for this step, asked with ``skip`` and
    ``norm`` on ``state_device``; where the transform declines it (it decides from its state,
    before anything is written), ``fallback``."""

    param_dtype: torch.dtype
    donate: bool
    state_device: torch.device
    fallback: Any
    target: Any = NewTensor()

    def run(self, tx, grads, master, tx_state, skip, norm):
        return run_fused(self, fused_whole, None, tx, grads, master, tx_state, skip, norm)


def run_fused(variant, kernel, chunk, tx, grads, master, tx_state, skip, norm):
    """A fused ``variant``'s step (``param_dtype``, ``donate``, ``state_device``, ``fallback``,
    ``target``): ``kernel`` (``fused_whole``, ``fused_chunks``) in chunks of ``chunk`` with the
    transform's ``FusedStep`` for this step, or the fallback where the transform declines it."""
    fused = ask_fused(tx, tx_state, grads, skip, norm, variant.state_device)
    if fused is None:
        return variant.fallback.run(tx, grads, master, tx_state, skip, norm)
    return kernel(tx, fused, grads, master, tx_state, skip, norm, param_dtype=variant.param_dtype, chunk=chunk,
                  donate=variant.donate, out=variant.target.out(master), cast=variant.target.casts)


def ask_fused(tx, tx_state, grads: ShardGrads, skip, norm, state_device: torch.device) -> FusedStep | None:
    """The transform's ``FusedStep`` with a kernel for this step's values, else ``None``."""
    fused = tx.fused(tx_state, grad_scale=grads.grad_scale.to(state_device), found_inf=skip, grad_norm=norm)
    return fused if fused is not None and fused.kernel is not None else None
