"""Gradients: the path that turns what a user passes as ``grads`` into this rank's reduced
shard, fixed at ``init`` (``GradPath``), and the grad function that reduces inside backward
(``GradFn``). The forms they produce are ``fzero.grad_forms``'s.

``GradPath.to_form`` is the door: it checks the grads once and gives ``Unreduced`` or ``Reduced``;
``GradPath.reduce`` turns either into ``Reduced`` (one reduce-scatter per bucket for the first).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optree
import torch

from . import backward, checks
from .comm import Comm, SimulatedComm
from .flat import concat, flatten_buckets, split_buckets, unflatten
from .grad_forms import Accumulated, Form, Reduced, Segments, Unreduced
from .layout import Layout
from .scaler import LossScaleState, scale_loss
from .tracing import compiling

__all__ = ["GradPath", "GradFn"]


@dataclasses.dataclass(frozen=True)
class GradPath:
    """Everything that turns this rank's grads into its reduced shard, fixed at ``init``.

    ``reduce_dtype``: the dtype grads are summed in over ranks (the param dtype at world size 1:
    nothing is summed, and the step's FP32 cast then fuses); ``wire_dtype``: the dtype the grads
    of a step cross the wire in -- the param dtype, or ``reduce_dtype`` (a copy in it,
    reduce-scattered; ``zero1``'s ``wire_dtype``); ``stage``: 1 or 2 (see ``accumulate``)."""

    layout: Layout
    comm: Comm | SimulatedComm
    device: torch.device
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    wire_dtype: torch.dtype
    stage: int

    @property
    def widened(self) -> bool:
        """Whether grads are summed over ranks in a dtype wider than the one they cross the wire
        in (BF16 or FP16 grads in FP32): then they are reduced as they come, and each rank sums
        the pieces it receives in ``reduce_dtype`` (``Comm.reduce_scatter_bucket``)."""
        return self.comm.data_parallel > 1 and self.reduce_dtype.itemsize > self.wire_dtype.itemsize

    # ------------------------------------------------------------------ the door
    def check(self, x: Any, what: str) -> list[torch.Tensor] | None:
        """Validate params or grads (``what``), given as the flat ``[N*S]`` buffer or as a pytree
        like the params, against the layout, device and param dtype; return the pytree's leaves
        (in the layout's order), or ``None`` if ``x`` is flat. The callers go on with these
        leaves rather than walk the tree again: traced, dynamo interprets each walk of a model's
        pytree bytecode by bytecode, a large part of a step's trace
        (benchmarks/results/history/compile_time.md)."""
        if isinstance(x, torch.Tensor) and x.shape == (self.layout.padded_numel,):
            checks.check_flat(x, self.layout, what=what, device=self.device, dtype=self.param_dtype)
            return None
        return checks.check_like_layout(x, self.layout, what=what, device=self.device, dtype=self.param_dtype)

    def buckets(self, grads: Any, dtype: torch.dtype) -> list[torch.Tensor]:
        """A grads pytree or flat buffer, checked, as one ``[N*S_b]`` buffer per bucket in
        ``dtype`` (views of a flat buffer already in ``dtype``)."""
        leaves = self.check(grads, "grads")
        if leaves is None:  # d(loss)/d(flat buffer): already laid out
            return [x.to(dtype) for x in split_buckets(grads, self.layout)]
        return flatten_buckets(leaves, self.layout, dtype=dtype)

    def to_form(self, grads: Any, *, segments: bool = False, donated: bool = False) -> Form:
        """What a user passes to ``step`` as grads, as ``Unreduced`` or ``Reduced``. ``segments``:
        at world size 1 (nothing to reduce) grads that are not ``Accumulated`` become a
        ``Reduced`` of ``Segments``: the caller's leaves (or flat grads) as they are.
        ``donated``: the caller gives the grads up (``donate=True``): with ranks to reduce over,
        flat grads are reduced in their own buffer."""
        if not isinstance(grads, Accumulated):
            if segments and self.comm.data_parallel == 1:
                return Reduced(self.segments(grads), 1.0, False)
            # Grads that cross the wire narrower than the reduce dtype are reduced as they are and
            # summed in it (``Communicator.reduce_scatter_mean``): no wider copy of them is made here.
            dtype, sum_dtype = self.wire_dtype, self.reduce_dtype if self.widened else None
            new_buffers = not isinstance(grads, torch.Tensor) or grads.dtype != dtype
            owned = new_buffers or (donated and self.comm.data_parallel > 1)
            return Unreduced(self.buckets(grads, dtype), owned, sum_dtype)
        if self._check_accumulated(grads):  # the sum over micro-batches is applied as it is (DDP's)
            return Reduced(grads.grads, self.comm.mean_factor(self.reduce_dtype), False)
        return Unreduced(split_buckets(grads.grads, self.layout), False)

    def segments(self, grads: Any) -> Segments:
        """A grads pytree or flat buffer, checked, as ``Segments`` of the flat ``[N*S]`` order
        (this rank's shard at world size 1): one piece per leaf (views of a flat buffer)."""
        leaves = self.check(grads, "grads")  # a pytree's leaves are the layout's leaves, in order
        if leaves is None:
            leaves = optree.tree_leaves(unflatten(grads, self.layout))
        # Ordered by offset (buckets fill in reverse); traced, in the leaves' order: dynamo may
        # trace the layout's ints as symbols, which it cannot sort, and the traced readers (the
        # compiled norm, fzero.cpu.leafwise) take the pieces in any order.
        n = len(leaves)
        order = range(n) if compiling() else sorted(range(n), key=lambda i: self.layout.offsets[i])
        return Segments(tuple(leaves[i].reshape(-1) for i in order), tuple(self.layout.offsets[i] for i in order),
                        self.layout.padded_numel, False)

    def _check_accumulated(self, acc: Accumulated) -> bool:
        """An ``Accumulated`` sum must be this rank's reduced ``[S]`` shard or the unreduced
        ``[N*S]`` flat grads of this layout; return whether it is reduced."""
        S, full = self.layout.shard_numel, self.layout.padded_numel
        g = acc.grads
        # Element by element: dynamo may trace the layout's ints as symbols, and a tuple
        # comparison of sizes then need not resolve (an `in` over tuples of them did not).
        if not (isinstance(g, torch.Tensor) and g.ndim == 1 and (g.shape[0] == S or g.shape[0] == full)
                and g.is_floating_point()):
            got = f"shape {tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(f"Accumulated grads are {got}; this engine takes a reduced shard ({S},) or unreduced "
                             f"flat grads ({full},), floating point: a sum from another engine?")
        if not isinstance(acc.count, torch.Tensor) or acc.count.ndim != 0:
            raise ValueError(f"Accumulated count must be a 0-d tensor, got {acc.count!r}")
        return g.shape[0] == S

    def reduce(self, form: Form) -> Reduced:
        """This rank's reduced shard (a reduce-scatter per bucket for ``Unreduced`` grads)."""
        if isinstance(form, Reduced):
            return form
        shard, factor = self.comm.reduce_scatter_mean(form.buckets, self.layout, donated=form.owned, dtype=form.sum_dtype)
        return Reduced(shard, factor, form.owned or self.comm.data_parallel > 1)

    # ------------------------------------------------------------------ micro-batches
    def accumulate(self, acc: Accumulated | None, grads: Any) -> Accumulated:
        """Add one micro-batch's grads to ``acc`` (``None`` starts a new sum); pass the result
        to ``step`` in place of grads for one update over all micro-batches, which applies the
        sum (DDP's ``no_sync``; see the module doc).

        Stage 1 keeps an FP32 buffer of the full padded size (4P bytes per rank) and
        reduce-scatters once, in ``step``. Stage 2 reduce-scatters every micro-batch and sums
        only this rank's shard in FP32 (4P/N bytes). Keep the loss scale fixed while
        accumulating (it only changes in ``step``): an inf/NaN in any micro-batch makes the sum
        non-finite, so the whole update is skipped."""
        if acc is not None and not isinstance(acc, Accumulated):
            raise TypeError(f"acc must be None or the Accumulated from accumulate, got {type(acc).__name__}")
        if acc is not None:
            self._check_accumulated(acc)
        if isinstance(grads, Accumulated):  # one micro-batch reduced already (grad_and_value): add shards
            self._check_accumulated(grads)
            part, count = grads.grads.float(), grads.count
        else:
            count = torch.ones((), dtype=torch.int32, device=self.device)
            if self.stage == 2:  # reduce-scatter every micro-batch, keep this rank's FP32 shard of the sum
                form = self.to_form(grads)
                part = self.comm.reduce_scatter_mean(form.buckets, self.layout, dtype=form.sum_dtype)[0].float()
            else:  # the FP32 [N*S] sum, reduced once, in step
                part = concat(self.buckets(grads, torch.float32))
        if acc is None:
            return Accumulated(part, count)
        if acc.grads.shape != part.shape:
            raise ValueError(f"cannot add grads of shape {tuple(part.shape)} to a sum of shape "
                             f"{tuple(acc.grads.shape)}: accumulate either reduced shards or unreduced grads")
        return Accumulated(acc.grads + part, acc.count + count)

    def grad_and_value(self, fn: Callable, params: Any, scaler_state: LossScaleState, args: tuple, kwargs: dict, *,
                       has_aux: bool, overlap: bool, acc: Accumulated | None = None,
                       sync: bool = True) -> tuple[Accumulated, Any]:
        """``GradFn``'s work (see there): differentiate ``fn(params, *args, **kwargs)`` times the
        loss scale, each bucket's reduce-scatter started inside backward (``fzero.backward``);
        ``acc``: the sum so far (``None``: none), added in; ``sync=False`` at stage 1: nothing
        is communicated, the FP32 ``[N*S]`` sum comes back."""
        if not isinstance(scaler_state, LossScaleState):
            raise TypeError("engine.grad_and_value: the grad function takes (params, scaler_state, *args); its second "
                            "argument must be the LossScaleState from init/step, got "
                            f"{type(scaler_state).__name__} (fn returns the plain loss: the grad function scales it)")
        if self.check(params, "params") is None:  # the flat buffer
            params = unflatten(params, self.layout)
        self._check_sum(acc)
        comm, layout, device = self.comm, self.layout, self.device
        local = not sync and self.stage == 1  # DDP's no_sync: summed here, reduced with the last micro-batch
        add = acc is not None and self.stage == 1 and sync  # the sum so far joins each bucket before it leaves
        # the sum so far leaves in the reduce dtype (an FP32 sum of micro-batches holds more than
        # 16 bits would carry); kept FP32 where nothing is summed over ranks (the reduce dtype is
        # then the param dtype), as stage-1 accumulation keeps it
        wire = torch.float32 if comm.data_parallel == 1 else self.reduce_dtype
        # one micro-batch's grads leave in the wire dtype, summed in the reduce dtype where it is wider
        sum_dtype = self.reduce_dtype if self.widened and not add else None
        if local or add:  # FP32 [N*S], as stage-1 accumulation sums
            total = torch.empty(layout.padded_numel, dtype=torch.float32, device=device)
            buffers = split_buckets(total, layout)
        else:
            buffers = [torch.empty(layout.world_size * b.shard, dtype=self.wire_dtype, device=device)
                       for b in layout.buckets]
        before = split_buckets(acc.grads, layout) if add else None

        def start(buf: torch.Tensor, i: int) -> torch.Tensor:  # buf: bucket i's [N*S_b] grads, ours
            if local:
                return buf
            if add:
                buf = buf.add_(before[i]).to(wire)
            return comm.start_mean(buf, i, layout, wait=not overlap, dtype=sum_dtype)

        def finish(x: torch.Tensor, i: int) -> torch.Tensor:
            return x if local else comm.wait_reduced(x, i, layout, dtype=sum_dtype)

        def scaled(tree: Any) -> tuple[torch.Tensor, Any]:
            out = fn(tree, *args, **kwargs)
            loss = out[0] if has_aux else out
            if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
                got = type(loss).__name__ + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                raise TypeError(f"fn must return a 0-d floating loss{' as (loss, aux)' if has_aux else ''}, got {got}")
            return scale_loss(loss, scaler_state), ((loss.detach(), out[1]) if has_aux else loss.detach())

        parts, value = backward.grad_and_value(scaled, params, layout, buffers, start, finish)
        one = torch.ones((), dtype=torch.int32, device=device)
        count = one if acc is None else acc.count + one
        if local:
            return Accumulated(total if acc is None else total.add_(acc.grads), count), value
        shard = concat(parts)
        if self.stage == 2 and (acc is not None or not sync):  # an FP32 sum of reduced shards
            shard = shard.float() if acc is None else acc.grads + shard.float()
        return Accumulated(shard, count), value

    def _check_sum(self, acc: Accumulated | None) -> None:
        """``acc`` must be ``None`` or a sum of this stage's form: stage 1 sums this rank's
        unreduced ``[N*S]`` grads (``no_sync``), stage 2 reduced ``[S]`` shards."""
        if acc is None:
            return
        if not isinstance(acc, Accumulated):
            raise TypeError(f"acc must be None or the Accumulated from no_sync, got {type(acc).__name__}")
        self._check_accumulated(acc)
        want = self.layout.padded_numel if self.stage == 1 else self.layout.shard_numel
        if acc.grads.shape[0] != want:
            form = "this rank's unreduced grads" if self.stage == 1 else "reduced shards"
            raise ValueError(f"acc has shape {tuple(acc.grads.shape)}; at stage {self.stage} micro-batches sum {form}, "
                             f"shape ({want},): pass the acc that no_sync returned")


class GradFn:
    """What ``Engine.grad_and_value(fn, has_aux=, overlap=)`` returns: the grads of the scaled
    loss, reduced over ranks, for ``step``. ``fn(params, *args, **kwargs)`` returns the plain
    0-d loss (or ``(loss, aux)`` with ``has_aux``); the grad function multiplies it by the loss
    scale itself, so that FP16 grads never miss it, and returns it unscaled:

    * ``g(params, scaler_state, *args, **kwargs) -> (grads, value)``: one batch. ``grads`` is an
      ``Accumulated`` of this rank's reduced ``[S]`` shard, each bucket's reduce-scatter started
      inside backward as soon as its grads exist (``fzero.backward``); ``value`` the unscaled
      loss (detached), or ``(loss, aux)``.
    * Micro-batches, as DDP's ``no_sync``: ``acc, value = g.no_sync(acc, params, scaler_state,
      *args, **kwargs)`` for all but the last (``acc=None`` starts), then ``grads, value =
      g.sync(acc, params, scaler_state, *args, **kwargs)`` for the last; ``step`` applies the
      sum of the micro-batches' grads, as DDP does: for the grads of the whole batch's mean
      loss, ``fn`` divides each micro-batch's loss by their number (``loss / ACCUM``, DDP's
      habit). Stage 1: ``no_sync`` communicates nothing, it sums this rank's grads in FP32
      (``[N*S]``, 4P bytes); ``sync`` adds that sum to each bucket before its reduce-scatter
      starts, still inside backward. Stage 2: every micro-batch is reduce-scattered in backward
      and only this rank's FP32 ``[S]`` shard of the sum is kept (4P/N bytes).

    ``params``: as from ``init``/``step`` (pytree or flat buffer); the arguments before ``*args``
    are positional only, so no keyword of ``fn`` can clash. Keep the loss scale fixed over the
    micro-batches of a step (it changes only in ``step``). ``overlap=False`` waits for each
    bucket inside backward (same results bitwise; for measuring). Eager only: under
    ``torch.compile`` differentiate the whole step with ``flat_params``. Raises when no param
    leaf reaches the loss (``fn`` called a module instead of ``apply``)."""

    def __init__(self, path: Callable[[], GradPath], fn: Callable, *, has_aux: bool, overlap: bool):
        self._path, self.fn, self.has_aux, self.overlap = path, fn, has_aux, overlap

    def __call__(self, params: Any, scaler_state: LossScaleState, /, *args, **kwargs) -> tuple[Accumulated, Any]:
        return self._run(None, True, params, scaler_state, args, kwargs)

    def no_sync(self, acc: Accumulated | None, params: Any, scaler_state: LossScaleState, /, *args,
                **kwargs) -> tuple[Accumulated, Any]:
        """A micro-batch before the last: ``(acc + its grads, value)``, nothing communicated at stage 1."""
        return self._run(acc, False, params, scaler_state, args, kwargs)

    def sync(self, acc: Accumulated | None, params: Any, scaler_state: LossScaleState, /, *args,
             **kwargs) -> tuple[Accumulated, Any]:
        """The last micro-batch: ``(grads for step, value)``, ``acc`` reduced with its grads."""
        return self._run(acc, True, params, scaler_state, args, kwargs)

    def _run(self, acc, sync, params, scaler_state, args, kwargs):
        return self._path().grad_and_value(self.fn, params, scaler_state, args, kwargs, has_aux=self.has_aux,
                                           overlap=self.overlap, acc=acc, sync=sync)
