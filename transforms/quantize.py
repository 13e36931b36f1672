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

A ``Quantized`` moment carries its own rules, so that no caller needs to know its layout: a
caller finds it with ``is_stored`` (optree's ``is_leaf``) and asks it for its flat length
(``numel``), a slice of the shard (``shard``: codes and their blocks' scales together), its FP32
value (``value``), FP32 values stored in its form (``stored``, or ``store_`` in place), and the
leaf a checkpoint holds for it (``saved``, and back: ``loaded``). It stays a pytree node of two
leaves, ``codes`` then ``scale``, the tensors a compiled step and a state see.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["BLOCK", "Quantized", "is_stored", "quantize", "dequantize", "block_scale", "zeros", "numel_blocks"]

BLOCK = 256  # elements per scale: 4 B of scale per 256 B of codes, 1.016 bytes per element
_SIGNED_LEVELS, _UNSIGNED_LEVELS = 127, 256


class Quantized(NamedTuple):
    """A moment stored in 8 bits. ``codes``: int8 (signed map) or uint8 (non-negative map),
    the moment's shape; ``scale``: FP32 ``[ceil(numel / BLOCK)]``, each block's largest
    magnitude (0 for an all-zero block)."""

    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def signed(self) -> bool:
        """Whether the codes are on the signed map (the first moment's) rather than the non-negative one."""
        return self.codes.dtype == torch.int8

    def numel(self) -> int:
        """Elements of the moment (of ``codes``, flattened)."""
        return self.codes.numel()

    def shard(self, lo: int, hi: int) -> "Quantized":
        """Elements ``[lo:hi]`` of the flattened moment: its codes ``[hi - lo]`` and the scales
        of their blocks ``[lo / BLOCK : ceil(hi / BLOCK)]``, views of this moment's tensors
        (writing them writes it). ``lo`` a block edge, ``hi`` a block edge or ``numel()``,
        else ``ValueError``: a block's scale belongs to all of its elements."""
        n = self.numel()
        if not (0 <= lo <= hi <= n and lo % BLOCK == 0 and (hi % BLOCK == 0 or hi == n)):
            raise ValueError(f"Quantized.shard({lo}, {hi}) of {n} elements: 8-bit moments keep one scale per "
                             f"{BLOCK} elements, so a slice starts at a multiple of {BLOCK} and ends at one or at {n}")
        return Quantized(self.codes.view(-1)[lo:hi], self.scale[lo // BLOCK: numel_blocks(hi)])

    def value(self) -> torch.Tensor:
        """The FP32 moment, shaped like ``codes`` (``dequantize``)."""
        return dequantize(self)

    def stored(self, x: torch.Tensor, *, peak: torch.Tensor | None = None) -> "Quantized":
        """FP32 ``x`` (``value()``'s shape) in this moment's form, new tensors: quantized on its map
        (``quantize``), with the block scales of ``peak`` when given (the same values as ``x``,
        computed again: see ``quantize``'s ``scale``)."""
        return quantize(x, signed=self.signed, scale=None if peak is None else block_scale(peak))

    def store_(self, x: torch.Tensor) -> "Quantized":
        """``stored(x)`` written into this moment's own tensors (a ``shard`` writes into the
        whole moment); returns ``self``."""
        new = self.stored(x)
        self.codes.copy_(new.codes)
        self.scale.copy_(new.scale)
        return self

    def saved(self) -> torch.Tensor:
        """The one leaf a checkpoint holds for this moment: its FP32 value, shaped like it. Codes
        and scales follow the saving engine's blocks; the value is elementwise, so an ``[S]``
        shard's maps to global coordinates ``[N]`` like any other ``[S]`` leaf and loads at any
        world size and in any moment dtype."""
        return self.value()

    def loaded(self, saved: torch.Tensor) -> "Quantized":
        """A checkpoint's leaf (``saved()`` of this moment's elements, possibly from another
        layout or dtype, as FP32) in this moment's form: quantized on its map into its blocks.
        ``loaded(saved())`` gives back the same codes and scales."""
        return self.stored(saved)


def is_stored(x) -> bool:
    """Whether ``x`` is a state node that stores a moment in a form of its own (``Quantized``)
    and carries its rules (module doc); use it as optree's ``is_leaf`` to meet such a node whole."""
    return isinstance(x, Quantized)


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
