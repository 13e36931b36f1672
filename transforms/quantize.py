"""Block-wise 8-bit storage of optimizer moments (``scale_by_adam(mu_dtype=torch.int8, ...)``).

A moment ``x`` is stored as 1-byte codes shaped like ``x`` and one FP32 scale per block of
``BLOCK`` consecutive elements (row-major order): the block's largest magnitude, so that each
block is quantized relative to its own range (Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization"; torchao's ``AdamW8bit`` and bitsandbytes use blocks of 256 too). With
``y = x / scale`` in ``[-1, 1]``, the codes follow a power map, encoded and decoded with
elementwise arithmetic only (no table lookup: it vectorizes on a CPU and fuses under
``torch.compile``):

* signed (the first moment): ``c = round(127 * sign(y) * |y|^(1/2))`` in int8,
  ``y = sign(c) * (c / 127)^2``: 2^-14 of the block's largest magnitude is the smallest
  non-zero value, the relative step is 2/127 at the top of the range.
* non-negative (the second moment, which spans many decades within a block):
  ``c = round(256 * y^(1/4) - 1)`` clamped to ``[0, 255]`` in uint8, ``y = ((c + 1) / 256)^4``:
  down to 2^-32 of the block's largest value, and never 0 unless the whole block is 0. Adam
  divides by ``sqrt(v)``: a second moment rounded to 0 under a non-zero first moment would make
  an update of ``m / eps`` -- the "zero-point problem" of Li et al. 2023 ("Memory Efficient
  Optimizers with 4-bit States"), whose fix (a map without 0) this is.

Why these maps (bitsandbytes' dynamic-tree map, a plain ``|y|^(1/2)`` map for the second
moment, and others were measured against FP32 moments on the main job's model):
docs/numerics.md, "8-bit moments", and ``benchmarks/quantization.py``.

``BLOCK`` divides every caller's chunks and shards: a flat shard under fzero's engine is a whole
number of blocks (``GradientTransformation.block``); a tensor of another size (a leaf in plain
use) has a last, partial block, zero-padded for the scale.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["BLOCK", "Quantized", "quantize", "dequantize", "block_scale", "zeros", "numel_blocks"]

BLOCK = 256  # elements per scale: 4 B of scale per 256 B of codes, 1.016 bytes per element
_SIGNED_LEVELS, _UNSIGNED_LEVELS = 127, 256


class Quantized(NamedTuple):
    """A moment stored in 8 bits. ``codes``: int8 (signed map) or uint8 (non-negative map),
    the moment's shape; ``scale``: FP32 ``[ceil(numel / BLOCK)]``, each block's largest
    magnitude (0 for an all-zero block)."""

    codes: torch.Tensor
    scale: torch.Tensor


def numel_blocks(numel: int) -> int:
    """Blocks of ``BLOCK`` elements that cover ``numel`` elements (the last one may be partial)."""
    return -(-numel // BLOCK)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened to ``[blocks, BLOCK]``, the last block zero-padded."""
    flat = x.reshape(-1)
    pad = -flat.numel() % BLOCK
    return (torch.nn.functional.pad(flat, (0, pad)) if pad else flat).view(-1, BLOCK)


def _unblocks(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[blocks, BLOCK]`` back to ``like``'s shape (padding dropped)."""
    return rows.reshape(-1)[: like.numel()].view(like.shape)


def zeros(like: torch.Tensor, *, signed: bool) -> Quantized:
    """All-zero codes and scales for a moment shaped like ``like`` (on its device)."""
    codes = torch.zeros(like.shape, dtype=torch.int8 if signed else torch.uint8, device=like.device)
    return Quantized(codes, torch.zeros(numel_blocks(like.numel()), dtype=torch.float32, device=like.device))


def block_scale(x: torch.Tensor) -> torch.Tensor:
    """Each block's largest magnitude of ``x``: FP32 ``[ceil(numel / BLOCK)]``, the scales
    ``quantize(x)`` stores."""
    return _peaks(_blocks(x.float()))


def _peaks(rows: torch.Tensor) -> torch.Tensor:
    return rows.abs().amax(dim=1)


def quantize(x: torch.Tensor, *, signed: bool, scale: torch.Tensor | None = None) -> Quantized:
    """``x`` (FP32; ``signed=False``: >= 0) in 8 bits with one scale per block (module doc).
    A non-finite element makes its block's scale non-finite (a skipped step never stores one).
    ``scale``: ``block_scale(x)``, when the caller computed it from a second evaluation of
    ``x`` (``scale_by_adam`` does under ``torch.compile``, to keep ``x`` out of memory).

    Each element is multiplied by its block's ``1 / scale`` instead of divided by ``scale``
    (a division per block, not per element: on a CPU the quantized update is bound by its
    divisions and square roots, ``benchmarks/moments.py``); a value at the scale may map to
    ``1 +- 2^-23``, which rounds to the top code all the same."""
    rows = _blocks(x.float())
    scale = _peaks(rows) if scale is None else scale  # (the rows made once)
    # 0-blocks: multiply by 1 instead of 1/0 (their codes are 0 either way)
    y = rows * torch.where(scale > 0, scale, 1.0).reciprocal().unsqueeze(1)
    if signed:
        codes = (y.abs().sqrt() * _SIGNED_LEVELS).round().copysign(y).to(torch.int8)
    else:
        codes = (y.sqrt().sqrt() * _UNSIGNED_LEVELS - 1).round().clamp(0, _UNSIGNED_LEVELS - 1).to(torch.uint8)
    return Quantized(_unblocks(codes, x), scale)


def dequantize(q: Quantized) -> torch.Tensor:
    """The FP32 moment that ``q`` stores, shaped like ``q.codes``: ``(c |c| / 127^2) scale``
    (signed) or ``((c + 1) / 256)^4 scale`` (non-negative), each division a multiplication by
    the reciprocal: ``c |c|`` is exact and ``127^2`` times FP32's ``1/127^2`` rounds to exactly
    1, so the top code gives back the scale itself (quantizing again gives the same scales);
    ``1/256`` is exact."""
    rows = _blocks(q.codes).float()
    if q.codes.dtype == torch.int8:
        y = rows * rows.abs() * (1 / _SIGNED_LEVELS**2)
    else:
        y = ((rows + 1) * (1 / _UNSIGNED_LEVELS)).square().square()
    # an all-zero block: scale 0 gives 0 whatever the codes (and the non-negative map has no 0)
    return _unblocks(y * q.scale.unsqueeze(1), q.codes)
