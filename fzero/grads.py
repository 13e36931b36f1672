"""Gradients: the two forms the step reduces from, and the ways to build them.

What a user passes as ``grads`` is converted once, at the door (``GradPath.to_form``), into
one of two forms, each with its micro-batch count:

* ``Unreduced(buckets, count)``: this rank's grads, one ``[N*S_b]`` buffer per bucket, summed
  over ``count`` micro-batches -- from a grads pytree (laid out by ``fzero.flat``), the grad of
  the flat buffer (``flat_params``), or a stage-1 ``Accumulated`` (its FP32 ``[N*S]`` sum);
* ``Reduced(shard, factor, count)``: this rank's ``[S]`` shard, already reduced over ranks:
  ``shard * factor`` is the sum over ``count`` micro-batches of the mean over ranks -- from
  ``grad_and_value`` (reduce-scattered inside backward, see ``fzero.backward``) or a stage-2
  ``Accumulated``.

``GradPath.reduce`` turns either into ``Reduced`` (one reduce-scatter per bucket for the first).
The ``factor`` (``Comm.mean_factor``) stays separate so that the step folds it into its one FP32
multiply with the unscale and the 1/count.

The eager fused step reads the reduced shard as ``Segments``, chunk by chunk; at world size 1
(nothing to reduce) they are the caller's grad leaves themselves, so a grads pytree is never laid
out into a new shard-sized buffer (on a CPU, fresh pages cost more than the update itself).
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Callable, NamedTuple, Union

import optree
import torch

from . import backward, checks
from .comm import Comm, SimulatedComm
from .flat import Layout, concat, flatten_buckets, split_buckets, unflatten

__all__ = ["Accumulated", "Unreduced", "Reduced", "Segments", "GradPath"]


class Accumulated(NamedTuple):
    """Gradients summed over ``count`` micro-batches (see ``Engine.accumulate``).

    ``grads``: this rank's (scaled) grads summed over micro-batches: the FP32 flat ``[N*S]``
    buffer (stage 1 ``accumulate``, 4P bytes), or this rank's ``[S]`` shard already summed
    over ranks (stage 2 ``accumulate``, 4P/N bytes; or one micro-batch from
    ``grad_and_value``). ``count``: 0-d int32 number of micro-batches in the sum."""

    grads: torch.Tensor
    count: torch.Tensor


class Unreduced(NamedTuple):
    """This rank's grads, one ``[N*S_b]`` buffer per bucket, summed over ``count`` micro-batches;
    ``owned``: the buffers are new (laid out from a pytree, or cast), not the caller's tensors."""

    buckets: list[torch.Tensor]
    count: torch.Tensor | int
    owned: bool


class Reduced(NamedTuple):
    """This rank's ``[S]`` shard reduced over ranks: ``shard * factor`` is the sum over ``count``
    micro-batches of the mean over ranks; ``owned``: ``shard`` is no caller's tensor, so the
    step may overwrite it."""

    shard: torch.Tensor
    factor: float
    count: torch.Tensor | int
    owned: bool


class Segments(NamedTuple):
    """An ``[S]`` grads shard in pieces, read chunk by chunk in FP32 (the eager fused update):
    ``parts[i]`` (1-D, any float dtype) holds elements ``[starts[i], starts[i] + numel)``, in
    order, not overlapping; elements no piece covers are zero (padding). A reduced shard is one
    piece; at world size 1, the grad leaves. ``owned``: the pieces may be overwritten."""

    parts: tuple[torch.Tensor, ...]
    starts: tuple[int, ...]
    numel: int
    owned: bool

    @classmethod
    def of(cls, shard: torch.Tensor, owned: bool) -> "Segments":
        return cls((shard,), (0,), shard.numel(), owned)

    def pieces(self, block: int) -> list[torch.Tensor]:
        """The parts cut at every multiple of ``block`` in shard coordinates: the same pieces
        (so the same sums, bitwise) for the same elements however they are held."""
        out = []
        for p, s in zip(self.parts, self.starts):
            lo, end = s, s + p.numel()
            while lo < end:
                hi = min(end, (lo // block + 1) * block)
                out.append(p[lo - s : hi - s])
                lo = hi
        return out

    def fp32(self, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        """Elements ``[lo, hi)`` as FP32 on ``device``, to be overwritten: a view of an owned FP32
        piece there when one covers them, else a new ``[hi - lo]`` tensor (a chunk: its memory
        is reused from chunk to chunk, where a shard-sized one would be fresh pages)."""
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        p, s = self.parts[i], self.starts[i]
        if self.owned and p.dtype == torch.float32 and p.device == device and s <= lo and hi <= s + p.numel():
            return p[lo - s : hi - s]
        out = torch.empty(hi - lo, dtype=torch.float32, device=device)
        pos = lo  # filled up to here
        for p, s in zip(self.parts[i:], self.starts[i:]):
            a, b = max(pos, s), min(hi, s + p.numel())
            if s >= hi:
                break
            if a < b:
                if a > pos:
                    out[pos - lo : a - lo].zero_()
                out[a - lo : b - lo].copy_(p[a - s : b - s])
                pos = b
        if pos < hi:
            out[pos - lo :].zero_()
        return out


Form = Union[Unreduced, Reduced]


@dataclasses.dataclass(frozen=True)
class GradPath:
    """Everything that turns this rank's grads into its reduced shard, fixed at ``init``.

    ``reduce_dtype``: the dtype grads are reduced in (the param dtype at world size 1: nothing
    is summed, and the step's FP32 cast then fuses); ``stage``: 1 or 2 (see ``accumulate``)."""

    layout: Layout
    comm: Comm | SimulatedComm
    device: torch.device
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    stage: int

    # ------------------------------------------------------------------ the door
    def check(self, x: Any, what: str) -> bool:
        """Validate params or grads (``what``), given as the flat ``[N*S]`` buffer or as a pytree
        like the params, against the layout, device and param dtype; return whether ``x`` is flat."""
        flat = isinstance(x, torch.Tensor) and x.shape == (self.layout.padded_numel,)
        check = checks.check_flat if flat else checks.check_like_layout
        check(x, self.layout, what=what, device=self.device, dtype=self.param_dtype)
        return flat

    def buckets(self, grads: Any, dtype: torch.dtype) -> list[torch.Tensor]:
        """A grads pytree or flat buffer, checked, as one ``[N*S_b]`` buffer per bucket in
        ``dtype`` (views of a flat buffer already in ``dtype``)."""
        if self.check(grads, "grads"):  # d(loss)/d(flat buffer): already laid out
            return [x.to(dtype) for x in split_buckets(grads, self.layout)]
        return flatten_buckets(grads, self.layout, dtype=dtype)

    def to_form(self, grads: Any, *, segments: bool = False) -> Form:
        """What a user passes to ``step`` as grads, as ``Unreduced`` or ``Reduced``. ``segments``:
        at world size 1 (nothing to reduce) grads that are not ``Accumulated`` become a
        ``Reduced`` of ``Segments``: the caller's leaves (or flat grads) as they are."""
        if not isinstance(grads, Accumulated):
            if segments and self.comm.data_parallel == 1:
                return Reduced(self.segments(grads), 1.0, 1, False)
            owned = not isinstance(grads, torch.Tensor) or grads.dtype != self.reduce_dtype  # new buffers
            return Unreduced(self.buckets(grads, self.reduce_dtype), 1, owned)
        if self._check_accumulated(grads):
            return Reduced(grads.grads, self.comm.mean_factor(self.reduce_dtype), grads.count, False)
        return Unreduced(split_buckets(grads.grads, self.layout), grads.count, False)

    def segments(self, grads: Any) -> Segments:
        """A grads pytree or flat buffer, checked, as ``Segments`` of the flat ``[N*S]`` order
        (this rank's shard at world size 1): one piece per leaf (views of a flat buffer)."""
        flat = self.check(grads, "grads")
        leaves = optree.tree_leaves(unflatten(grads, self.layout)) if flat else self.layout.treespec.flatten_up_to(grads)
        order = sorted(range(len(leaves)), key=lambda i: self.layout.offsets[i])  # buckets fill in reverse
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
        shard, factor = self.comm.reduce_scatter_mean(form.buckets, self.layout)
        return Reduced(shard, factor, form.count, form.owned or self.comm.data_parallel > 1)

    # ------------------------------------------------------------------ micro-batches
    def accumulate(self, acc: Accumulated | None, grads: Any) -> Accumulated:
        """Add one micro-batch's grads to ``acc`` (``None`` starts a new sum); pass the result
        to ``step`` in place of grads for one update over all micro-batches.

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
                part = self.comm.reduce_scatter_mean(self.buckets(grads, self.reduce_dtype), self.layout)[0].float()
            else:  # the FP32 [N*S] sum, reduced once, in step
                part = concat(self.buckets(grads, torch.float32))
        if acc is None:
            return Accumulated(part, count)
        if acc.grads.shape != part.shape:
            raise ValueError(f"cannot add grads of shape {tuple(part.shape)} to a sum of shape "
                             f"{tuple(acc.grads.shape)}: accumulate either reduced shards or unreduced grads")
        return Accumulated(acc.grads + part, acc.count + count)

    def grad_and_value(self, fn: Callable, params: Any, args: tuple, kwargs: dict, *, has_aux: bool,
                       overlap: bool) -> tuple[Accumulated, Any]:
        """``torch.func.grad_and_value(fn)(params, *args, **kwargs)``, with each bucket's
        reduce-scatter started *inside* backward, as soon as that bucket's grads exist (see
        ``fzero.backward``): communication overlaps the rest of backward.

        Returns ``(grads, value)``: ``params`` as from ``init``/
        ``step`` (pytree or flat buffer), ``fn(params, ...)`` returns the (scaled) 0-d loss, or
        ``(loss, aux)`` with ``has_aux``; ``grads`` is an ``Accumulated`` of this rank's ``[S]``
        reduced shard for ``step`` (or ``accumulate``, which then adds shards: 4P/N bytes at
        any stage). ``overlap=False`` waits for each bucket inside backward instead (same
        results bitwise; for measuring). Eager only; under ``torch.compile`` differentiate
        the whole step with ``flat_params``."""
        if self.check(params, "params"):
            params = unflatten(params, self.layout)
        comm, layout = self.comm, self.layout

        def start(buf: torch.Tensor, i: int) -> torch.Tensor:  # buf: [N*S_b] grads in reduce_dtype, ours
            return comm.start_mean(buf, i, layout, wait=not overlap)

        def finish(x: torch.Tensor, i: int) -> torch.Tensor:
            return comm.wait_reduced(x, i, layout)

        shard, value = backward.grad_and_value(fn, params, layout, start, finish, args, kwargs,
                                               dtype=self.reduce_dtype, has_aux=has_aux)
        return Accumulated(shard, torch.ones((), dtype=torch.int32, device=self.device)), value
