"""The forms of gradients the step reduces from, and the shard it reads.

What a user passes as ``grads`` is converted once, at the door (``fzero.grads.GradPath.to_form``),
into one of two forms:

* ``Unreduced(buckets, owned)``: this rank's grads, one ``[N*S_b]`` buffer per bucket -- from a
  grads pytree (laid out by ``fzero.flat``), the grad of the flat buffer (``flat_params``), or a
  stage-1 ``Accumulated`` (its FP32 ``[N*S]`` sum over micro-batches);
* ``Reduced(shard, factor)``: this rank's ``[S]`` shard, already reduced over ranks:
  ``shard * factor`` is the mean over ranks (of the sum over micro-batches, for an
  ``Accumulated``) -- from a ``GradFn`` (``Engine.grad_and_value``: reduce-scattered inside
  backward, see ``fzero.backward``) or a stage-2 ``Accumulated``.

Micro-batches are summed, as DDP sums them under ``no_sync``: the step applies the sum over
micro-batches of each one's grads averaged over ranks, never their mean. For the grads of the
whole batch's mean loss, divide each micro-batch's loss by the number of micro-batches
(``loss / ACCUM``, as with DDP and ``torch.optim``). ``Accumulated.count`` only reports how many
micro-batches a sum holds; the step divides by none.

The ``factor`` (``Comm.mean_factor``) stays separate so that the step folds it into its one FP32
multiply with the unscale. The eager fused step reads the reduced shard as ``Segments``, chunk by
chunk; at world size 1 (nothing to reduce) they are the caller's grad leaves themselves, so a
grads pytree is never laid out into a new shard-sized buffer (on a CPU, fresh pages cost more
than the update itself).
"""
from __future__ import annotations

import bisect
from typing import NamedTuple, Union

import torch

__all__ = ["Accumulated", "Unreduced", "Reduced", "Segments", "Form"]


class Accumulated(NamedTuple):
    """Gradients summed over ``count`` micro-batches (``GradFn``, ``Engine.accumulate``); the
    step applies the sum as it is, as DDP's ``no_sync`` does (see the module doc).

    ``grads``: this rank's (scaled) grads summed over micro-batches: the FP32 flat ``[N*S]``
    buffer (stage 1 ``no_sync``/``accumulate``, 4P bytes), or this rank's ``[S]`` shard already
    summed over ranks (stage 2, 4P/N bytes; or what a ``GradFn`` call or ``sync`` returns).
    ``count``: 0-d int32 number of micro-batches in the sum, for reporting (the step does not
    divide by it)."""

    grads: torch.Tensor
    count: torch.Tensor


class Unreduced(NamedTuple):
    """This rank's grads, one ``[N*S_b]`` buffer per bucket (of one batch, or summed over
    micro-batches); ``owned``: the buffers are new (laid out from a pytree, or cast), not the
    caller's tensors; ``sum_dtype``: the dtype to sum them in over ranks where it is wider than
    theirs (else ``None``: in their own)."""

    buckets: list[torch.Tensor]
    owned: bool
    sum_dtype: torch.dtype | None = None


class Reduced(NamedTuple):
    """This rank's ``[S]`` shard reduced over ranks: ``shard * factor`` is the mean over ranks
    (summed over micro-batches, for an ``Accumulated``, as DDP's ``no_sync`` sums them);
    ``owned``: ``shard`` is no caller's tensor, so the step may overwrite it."""

    shard: torch.Tensor
    factor: float
    owned: bool


class Segments(NamedTuple):
    """An ``[S]`` grads shard in pieces, read chunk by chunk in FP32 (the eager fused update):
    ``parts[i]`` (1-D, any float dtype) holds elements ``[starts[i], starts[i] + numel)``, in
    order (eager; ``GradPath.segments`` traced: in the leaves' order), not overlapping; elements
    no piece covers are zero (padding). A reduced shard is one
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
