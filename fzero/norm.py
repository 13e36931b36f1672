"""The grad norm's sum of squares over this rank's grads (``Segments``), as a 0-d float64: the
eager rows of ``NORM_ROW`` elements in blocks of ``NORM_BLOCK``, or the compiled whole parts.
fzero's own CPU kernel takes the same rows (``fzero.cpu.kernel.NativeNorm``)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .grad_forms import Segments

__all__ = ["sum_of_squares", "RowNorm", "NORM_BLOCK", "NORM_ROW"]

NORM_BLOCK, NORM_ROW = 2**18, 256  # the eager sum of squares: elements per block, per row


def sum_of_squares(g: Segments, *, bounded: bool, compiled: bool = False) -> torch.Tensor:
    """``sum(g**2)`` over the elements of ``g`` as a 0-d float64; non-finite iff some element
    is inf or NaN.

    The norms of rows of ``NORM_ROW`` elements, squared and summed in float64. Eager, the rows
    are those of ``g.pieces(NORM_BLOCK)`` (any cast stays block-sized), the same pieces whether
    ``g`` is a grads pytree or the flat buffer, whatever ``chunk_numel``: so is the result,
    bitwise. ``compiled`` (traced by ``torch.compile``): of the whole parts (inductor fuses the
    cast). Each row's norm is accumulated in

    * FP32 when ``bounded``: every element is a sum of at most 2^30 FP16 values, ranks times
      micro-batches (|g| <= 7e13: squared and summed over a row, far below 3.4e38);
    * FP32, the row first multiplied by ``1 / m``, ``m`` half its mean magnitude (at least its
      largest over ``2 * NORM_ROW``), for BF16 and FP32 grads ``compiled``: every scaled
      element is at most ``2 * NORM_ROW``, so no square can overflow (the grads reach 3.4e38,
      whose square FP32 cannot hold), and the largest at least 2 (a row of tiny or subnormal
      values is multiplied by 2^100), so nothing is lost that the row's norm would show
      (``_scaled_row_sumsq``). Inductor's float64 reduction on a CPU is the slower one
      (docs/performance.md); eager, the same in small ops would be slower than float64;
    * float64 otherwise (eager BF16 or FP32): it never overflows for finite inputs.

    Each is exact to ~1e-7 relative (a running sum of 256 terms; one over 2^18 terms would lose
    1e-4)."""
    # Each piece's full rows, then every tail that fills no row, zero-padded.
    scaled = compiled and not bounded
    dtype = torch.float32 if bounded or scaled else torch.float64
    rows, tails = [], []
    for p in g.parts if compiled else g.pieces(NORM_BLOCK):
        n = p.numel() // NORM_ROW * NORM_ROW
        rows += [p[:n].view(-1, NORM_ROW)] if n else []
        tails += [p[n:]] if n < p.numel() else []
    if tails:
        pad = -sum(t.numel() for t in tails) % NORM_ROW
        tails = torch.cat([t.to(dtype) for t in tails] + [tails[0].new_zeros(pad, dtype=dtype)])
        rows.append(tails.view(-1, NORM_ROW))
    if scaled:
        # Summed part by part, not concatenated first: the rows' scales and scaled sums of
        # squares then need no buffer, and inductor runs both reductions in one loop over the grads.
        return sum(_scaled_row_sumsq(r).sum() for r in rows)
    norms = [torch.linalg.vector_norm(r, dim=1, dtype=dtype) for r in rows]
    return torch.cat(norms).double().square().sum()


def _scaled_row_sumsq(rows: torch.Tensor) -> torch.Tensor:
    """``[R, NORM_ROW]`` -> ``[R]`` float64 sums of squares, each taken in FP32 of the row
    multiplied by ``s = 1 / m``, ``m`` the sum of its magnitudes over ``2 * NORM_ROW``; then
    divided by ``s**2`` in float64 (the same ``s``: only the FP32 products round, ~1e-7 relative).

    With ``a`` the row's largest magnitude, ``a / (2 * NORM_ROW) <= m <= a / 2``: the scaled
    elements are at most ``2 * NORM_ROW`` and the largest at least 2. ``m`` is kept in
    ``[2**-100, 2**126]``: below (all zeros, or subnormal grads whose terms underflowed),
    ``s = 2**100``, exact, which lifts every subnormal into normal range; above (a finite row
    reaches at most ``2**127``, and only in FP32's top octave), ``s = 2**-126``, under which
    such a row's largest is still at least 2 and at most 4. An inf makes ``m`` inf and ``s``
    ``2**-126``: the sum is inf, as the float64 sum of the squares would be; a NaN makes it NaN.

    The mean magnitude, not the largest: inductor's CPU code takes a max reduction with NaN
    propagation, about twice the vector operations of a sum (the compiled BF16 step on the flat
    buffer, docs/performance.md)."""
    x = rows.float()
    m = (x.abs() * (0.5 / NORM_ROW)).sum(dim=1, keepdim=True).clamp(_MIN_MEAN, _MAX_MEAN)
    s = 1.0 / m
    sumsq = (x * s).square().sum(dim=1)
    return sumsq.double() / s.squeeze(1).double().square()


_MIN_MEAN, _MAX_MEAN = 2.0**-100, 2.0**126  # the row scales' inverses: powers of two, FP32 normals


class RowNorm(NamedTuple):
    """``sum_of_squares`` as the step takes it: ``compiled``, traced by ``torch.compile``."""

    compiled: bool = False

    def __call__(self, g: Segments, *, bounded: bool) -> torch.Tensor:
        return sum_of_squares(g, bounded=bounded, compiled=self.compiled)
