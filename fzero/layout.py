"""Flat layout: where each leaf of a pytree lives in one contiguous, padded, rank-sharded buffer.

Leaf order is optree's: ``optree.tree_flatten`` order, in which dict keys are *sorted*
(not insertion order), lists/tuples/NamedTuples go field by field, and ``None`` is an empty
subtree. Leaf ``i`` occupies ``flat[offsets[i] : offsets[i] + numel_i]``.

One bucket (the default) holds every leaf in that order. With ``bucket_numel`` the leaves are
packed into buckets in *reverse* leaf order -- for a params pytree listed in forward order, the
order backward produces their grads, so the first bucket's grads are complete first -- each
bucket closed once it holds ``bucket_numel`` elements (a leaf is never split across buckets).

Each bucket is zero-padded to ``N * S_b`` elements, ``S_b`` a multiple of ``alignment``, so it
splits into ``N`` equal contiguous shards; rank ``r`` owns ``bucket[r*S_b : (r+1)*S_b]`` of
every bucket (as Megatron's DistributedOptimizer does), and its *shard* is the concatenation of
those slices (``S = sum_b S_b`` elements). A parameter may straddle two ranks. With one bucket
the padding is ``< N * alignment`` elements and rank ``r`` owns ``flat[r*S : (r+1)*S]``.

A ``Layout`` holds no tensors; ``fzero.flat`` copies a pytree into such a buffer and views one
as a pytree.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import optree
import torch

from fzero.transforms.tree import leaf_paths

from .tree_code import builder

__all__ = ["Bucket", "Layout", "make_layout", "DEFAULT_ALIGNMENT"]

DEFAULT_ALIGNMENT = 64  # elements; 128 B of fp16, 256 B of fp32: aligned vector loads on every rank


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Leaves ``leaves`` (indices in tree order), laid out in that order at
    ``flat[start : start + world_size*shard]``."""

    leaves: tuple[int, ...]
    start: int
    numel: int  # unpadded
    shard: int  # elements per rank


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static description of the flat buffer; no tensors, hashable, identical on every rank.
    Its derived sizes are cached properties, each computed once (``make_layout`` computes them)."""

    treespec: optree.PyTreeSpec
    paths: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    world_size: int
    alignment: int

    @functools.cached_property
    def numel(self) -> int:
        """P: parameter elements, padding excluded."""
        return sum(math.prod(s) for s in self.shapes)

    @functools.cached_property
    def padded_numel(self) -> int:
        """Elements of the flat buffer, padding included (= world_size * shard_numel)."""
        return self.world_size * self.shard_numel

    @functools.cached_property
    def shard_numel(self) -> int:
        """S: elements each rank owns."""
        return sum(b.shard for b in self.buckets)

    @functools.cached_property
    def split_sizes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(sizes, where)``: the flat buffer cut, in buffer order, into the leaves and each
        bucket's padding (``sizes``, summing to ``padded_numel``); leaf ``i`` is piece
        ``where[i]``. A bucket holds its leaves back to back in the order it lists them."""
        sizes, where = [], [0] * len(self.shapes)
        for b in self.buckets:
            for i in b.leaves:
                where[i] = len(sizes)
                sizes.append(math.prod(self.shapes[i]))
            if self.world_size * b.shard > b.numel:
                sizes.append(self.world_size * b.shard - b.numel)
        return tuple(sizes), tuple(where)

    def shard_ranges(self, rank: int) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` flat ranges rank owns, one per bucket, in shard order."""
        return [(b.start + rank * b.shard, b.start + (rank + 1) * b.shard) for b in self.buckets]

    @functools.cached_property
    def tree_builder(self):
        """``leaves -> the params pytree`` as generated code (``fzero.tree_code.builder``), or
        ``None`` for a structure it does not build: what ``unflatten`` traces."""
        return builder(self.treespec)

    def __getstate__(self) -> dict:
        # the fields only: the derived values are computed again, and generated code does not pickle
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @functools.cached_property
    def global_offsets(self) -> tuple[int, ...]:
        """Where each leaf starts in the *global* ``[P]`` vector: the leaves concatenated in
        tree order, without padding (coordinates that do not depend on the world size, the
        alignment or the bucketing)."""
        out, g = [], 0
        for shape in self.shapes:
            out.append(g)
            g += math.prod(shape)
        return tuple(out)

    def owned(self, rank: int) -> list[tuple[int, int, int]]:
        """The real elements rank ``rank`` owns, in global coordinates: ``[(g0, g1, pos), ...]``,
        sorted by ``g0``, adjacent ranges merged, each saying that ``global[g0:g1]`` is
        ``shard[pos : pos + g1 - g0]`` of the rank's ``[S]`` shard. Padding is in no range;
        the ranges of ranks ``0 .. world_size-1`` tile ``[0, P)``. Any bucketing, any alignment."""
        starts = self.global_offsets
        pieces = []
        pos = 0  # where this bucket's slice starts in the rank's shard
        for bucket, (lo, hi) in zip(self.buckets, self.shard_ranges(rank)):
            for i in bucket.leaves:
                a = self.offsets[i]
                s, e = max(a, lo), min(a + math.prod(self.shapes[i]), hi)
                if s < e:
                    pieces.append((starts[i] + s - a, starts[i] + e - a, pos + s - lo))
            pos += hi - lo
        pieces.sort()
        merged: list[tuple[int, int, int]] = []
        for g0, g1, p in pieces:
            if merged and merged[-1][1] == g0 and merged[-1][2] + g0 - merged[-1][0] == p:
                merged[-1] = (merged[-1][0], g1, merged[-1][2])
            else:
                merged.append((g0, g1, p))
        return merged

    def table(self) -> dict[str, str]:
        """Everything about the layout that must agree across ranks, as printable entries
        (leaf by leaf first, so a disagreement names the first differing leaf)."""
        out = {f"leaf {i}": f"{p!r} with shape {tuple(s)}" for i, (p, s) in enumerate(zip(self.paths, self.shapes))}
        out["number of leaves"] = str(len(self.paths))
        out["alignment"] = str(self.alignment)
        out["buckets"] = repr([b.leaves for b in self.buckets])
        out["world size"] = str(self.world_size)
        return out


def make_layout(
    tree: Any,
    world_size: int,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    bucket_numel: int | None = None,
) -> Layout:
    """Lay out the leaves of ``tree`` (tensors or anything with ``.shape``) for ``world_size`` ranks.

    ``bucket_numel``: buckets of at least this many elements (but the last), filled in reverse
    leaf order; ``None`` = one bucket in leaf order.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    paths, leaves, spec = leaf_paths(tree)
    shapes = tuple(torch.Size(leaf.shape) for leaf in leaves)
    numels = [math.prod(s) for s in shapes]
    groups: list[list[int]] = [[]]
    filled = 0
    order = range(len(leaves)) if bucket_numel is None else reversed(range(len(leaves)))
    for i in order:
        n = numels[i]
        if bucket_numel is not None and groups[-1] and filled >= bucket_numel:
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += n
    offsets = [0] * len(leaves)
    buckets = []
    start = 0
    for group in groups:
        pos = start
        for i in group:
            offsets[i] = pos
            pos += numels[i]
        numel = pos - start
        shard = max(1, math.ceil(numel / (world_size * alignment))) * alignment
        buckets.append(Bucket(tuple(group), start, numel, shard))
        start += world_size * shard
    layout = Layout(spec, tuple(paths), shapes, tuple(offsets), tuple(buckets), world_size, alignment)
    for name in ("numel", "shard_numel", "padded_numel", "split_sizes", "global_offsets", "tree_builder"):
        getattr(layout, name)  # computed once, here: where torch.compile traces, read as constants
    return layout
