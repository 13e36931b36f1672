"""Flat layout: a pytree of tensors <-> one contiguous, padded, rank-sharded buffer.

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
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import optree
import torch

from fzero.transforms.base import leaf_paths

from .mode import compiling

__all__ = [
    "Layout",
    "make_layout",
    "flatten",
    "flatten_buckets",
    "split_buckets",
    "unflatten",
    "shard_of",
    "tree_shard",
    "leaf_paths",
    "leaf_views",
    "tree_leaves",
    "concat",
    "per_leaf_shard",
    "flat_buffer",
    "check_in_buffer",
]

DEFAULT_ALIGNMENT = 64  # elements; 128 B of fp16, 256 B of fp32: aligned vector loads on every rank


def concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` without the copy when there is one part (one bucket: a view)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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
    """Static description of the flat buffer; no tensors, hashable, identical on every rank."""

    treespec: optree.PyTreeSpec
    paths: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    world_size: int
    alignment: int

    @property
    def numel(self) -> int:
        """P: parameter elements, padding excluded."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def padded_numel(self) -> int:
        """Elements of the flat buffer, padding included (= world_size * shard_numel)."""
        return self.world_size * self.shard_numel

    @property
    def shard_numel(self) -> int:
        """S: elements each rank owns."""
        return sum(b.shard for b in self.buckets)

    @property
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

    @property
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
    return Layout(spec, tuple(paths), shapes, tuple(offsets), tuple(buckets), world_size, alignment)


def tree_leaves(tree: Any) -> list:
    """``optree.tree_leaves(tree)``, where a list of tensors is its own leaves (the stages pass
    leaves they walked once already): traced, optree's walk of such a list is some 200 bytecode
    instructions per leaf that dynamo interprets."""
    if isinstance(tree, list) and all(isinstance(x, torch.Tensor) for x in tree):
        return tree
    return optree.tree_leaves(tree)


def flatten_buckets(tree: Any, layout: Layout, *, dtype: torch.dtype | None = None,
                    out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The leaves copied into one ``[world_size * S_b]`` buffer per bucket, in ``dtype``
    (default: the first leaf's, or ``out``'s), zero-padded: new buffers, or with ``out`` (a
    ``[padded_numel]`` buffer, eager only) its bucket views, written in place.

    A bucket's buffer depends only on its own leaves, so its reduce-scatter can start as soon
    as those grads exist. Eager mode casts while it copies (``torch.cat(out=)``); under
    ``torch.compile`` inductor turns each ``cat`` into one concat kernel (with many leaves,
    better than fusing a many-way select into the step's kernel).
    """
    leaves = tree_leaves(tree)  # GradPath.buckets passes the leaves it checked
    if out is not None:
        if compiling():
            raise ValueError("flatten(out=...) is eager only: under torch.compile, use the returned buffer")
        if out.shape != (layout.padded_numel,):
            raise ValueError(f"out has shape {tuple(out.shape)}, the layout needs ({layout.padded_numel},)")
    dtype = dtype or (leaves[0].dtype if out is None else out.dtype)
    device = leaves[0].device
    targets = split_buckets(out, layout) if out is not None else [None] * len(layout.buckets)
    result = []
    for b, target in zip(layout.buckets, targets):
        size = layout.world_size * b.shard
        parts = [leaves[i].reshape(-1) for i in b.leaves]
        parts.append(torch.zeros(size - b.numel, dtype=dtype, device=device))
        if compiling():
            result.append(torch.cat([p.to(dtype) for p in parts]))
        else:
            target = torch.empty(size, dtype=dtype, device=device) if target is None else target
            result.append(torch.cat(parts, out=target))
    return result


def flatten(tree: Any, layout: Layout, *, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the leaves into a new ``[padded_numel]`` buffer of ``dtype`` (default: first leaf's),
    or into ``out`` (eager only), which is returned: a buffer written in place every step is
    allocated once (on a CPU, a new buffer above glibc's mmap threshold is fresh pages from
    the kernel every time).

    Padding is zero, so it never contributes to sums or norms."""
    buckets = flatten_buckets(tree, layout, dtype=dtype, out=out)
    return out if out is not None else concat(buckets)


def split_buckets(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Views of a ``[padded_numel]`` buffer, one per bucket."""
    return [flat[b.start : b.start + layout.world_size * b.shard] for b in layout.buckets]


@torch.library.custom_op("fzero::cat_into", mutates_args=("out",))
def _cat_into(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """``torch.cat(parts, out=out)`` as an op that ``torch.compile`` keeps whole. Traced as
    copies into slices of ``out``, inductor fuses them into one loop over ``out`` that tests
    every element against every piece's range (a GPT's backward took 1.6x as long); traced as
    ``out.copy_(torch.cat(parts))``, it writes a new buffer of the whole size and copies it."""
    torch.cat(parts, out=out)


@_cat_into.register_fake
def _(parts, out) -> None:
    return None


class _SplitGradsInto(torch.autograd.Function):
    """``flat.split(sizes)``, whose backward writes the pieces' grads into ``into`` (zeros
    where a piece got none; one concatenation into it) and gives ``flat`` no grad of its own."""

    @staticmethod
    def forward(ctx, flat, into, sizes):
        ctx.into = into
        return flat.split(sizes)

    @staticmethod
    def backward(ctx, *grads):
        torch.ops.fzero.cat_into(list(grads), ctx.into)
        return None, None, None


def leaf_views(flat: torch.Tensor, layout: Layout, grads_into: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The leaves' views of a ``[padded_numel]`` buffer, in the layout's leaf order and shapes
    (``unflatten``'s leaves, without building the tree); ``grads_into`` as ``unflatten`` takes it."""
    # One split into the leaves and the gaps between them (in buffer order), not a slice per
    # leaf: the same views, but autograd's backward of a split is one concatenation, which
    # inductor writes straight into one buffer; the backward of N slices is N scatters into
    # zeroed copies of the whole buffer (differentiating ``engine.flat_params``).
    sizes, where = layout.split_sizes
    parts = torch.split(flat, sizes) if grads_into is None else _SplitGradsInto.apply(flat, grads_into, sizes)
    return [parts[k].view(s) for k, s in zip(where, layout.shapes)]


def check_in_buffer(buffer: torch.Tensor, leaves: list[torch.Tensor], offsets: list[int]) -> None:
    """Raise ``ValueError`` unless ``buffer`` lies within its storage and each of ``leaves`` is a
    contiguous view of that storage starting ``offsets[i]`` elements into ``buffer`` (eager:
    reads storages and data pointers, which a traced step cannot)."""
    storage, size = buffer.untyped_storage(), buffer.element_size()
    if buffer.data_ptr() + buffer.numel() * size > storage.data_ptr() + storage.nbytes():
        raise ValueError(f"params are not views of one flat buffer of {buffer.numel()} elements starting where its "
                         "memory starts: pass the params init/step returned (compiled with donate=True, the step "
                         "casts into their buffer)")
    for i, (x, o) in enumerate(zip(leaves, offsets)):
        if (not x.is_contiguous() or x.untyped_storage().data_ptr() != storage.data_ptr()
                or x.data_ptr() != buffer.data_ptr() + o * size):
            raise ValueError(f"params leaf {i} is not at its offset {o} in the params' flat buffer: pass the params "
                             "init/step returned (compiled with donate=True, the step casts into their buffer)")


def unflatten(flat: torch.Tensor, layout: Layout, *, like: Any = None, grads_into: torch.Tensor | None = None) -> Any:
    """The pytree whose leaves are *views* into ``flat`` (writes to a leaf write the buffer).

    ``like``: a pytree with the layout's structure to take the structure from. Inside
    ``torch.compile`` pass one (e.g. the params): dynamo rebuilds trees only from structures
    it traced itself, not from the ``PyTreeSpec`` stored in the layout.

    ``grads_into``: a ``[padded_numel]`` buffer of ``flat``'s dtype and device, which backward
    through the leaves fills with their grads, laid out as ``flat`` (every element: zeros for
    padding and for leaves the loss does not use), in place of a grad for ``flat``
    (``flat.grad`` stays ``None``). A buffer kept across steps and handed to ``engine.step``
    as the flat grads: no new grads buffer each step (on a CPU, a new buffer above glibc's
    mmap threshold is fresh pages from the kernel every time). Each leaf's grad is made on
    its own and one concatenation lays them out into ``grads_into``. Each backward
    *overwrites* it, where ``flat.grad`` would accumulate over backward calls: for several
    micro-batches, add each one's grads up before the step. For ``loss.backward()``; under
    ``torch.func.grad`` differentiate ``flat`` itself."""
    if flat.ndim != 1 or flat.numel() != layout.padded_numel:
        raise ValueError(f"flat buffer has shape {tuple(flat.shape)}, layout needs ({layout.padded_numel},)")
    if grads_into is not None:
        _check_grads_into(grads_into, flat)
    spec = layout.treespec if like is None else optree.tree_structure(like)
    return optree.tree_unflatten(spec, leaf_views(flat, layout, grads_into))


def _check_grads_into(into: torch.Tensor, flat: torch.Tensor) -> None:
    """``unflatten``'s ``grads_into`` is a buffer like ``flat`` and not ``flat`` itself."""
    got = (tuple(into.shape), into.dtype, into.device)
    if got != (tuple(flat.shape), flat.dtype, flat.device) or into.requires_grad:
        raise ValueError(f"unflatten: grads_into is {got[1]} of shape {got[0]} on {got[2]}"
                         f"{' requiring grad' if into.requires_grad else ''}; it must be a buffer like the flat "
                         f"params: {flat.dtype} of shape {tuple(flat.shape)} on {flat.device}, not requiring grad")
    if compiling():  # data pointers exist on real tensors only, not on the fakes dynamo traces with
        return
    from .checks import shared_memory  # fzero.checks imports this module

    if torch._C._functorch.is_functorch_wrapped_tensor(flat):
        raise ValueError("unflatten: grads_into is where loss.backward() writes the grads; under a torch.func "
                         "transform (grad, vjp) leave it out and differentiate the flat params themselves")
    if shared_memory([into, flat]) is not None:
        raise ValueError("unflatten: grads_into shares memory with the flat params; backward would overwrite "
                         "the params with their grads")


def shard_of(flat: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``[S]`` shard of a full flat buffer (a view when there is one bucket, and
    at world size 1, where it is the whole buffer)."""
    if layout.world_size == 1:
        return flat
    parts = [flat[a:b] for a, b in layout.shard_ranges(rank)]
    return concat(parts)


def tree_shard(tree: Any, layout: Layout, rank: int, *, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s ``[S]`` shard of ``flatten(tree)``, built without the full buffer.

    Copies only the parts of leaves that overlap the rank's ranges: memory ``S`` elements,
    whatever ``P`` is. Used at init (master weights) and to simulate any rank of any world
    size on one device.
    """
    leaves = layout.treespec.flatten_up_to(tree)
    device = leaves[0].device if leaves else None
    out = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
    starts = layout.global_offsets
    ends = [g + math.prod(s) for g, s in zip(starts, layout.shapes)]
    i = 0  # the leaf holding global element g0 (ranges are sorted: i only grows)
    for g0, g1, pos in layout.owned(rank):
        while g0 < g1:
            while ends[i] <= g0:
                i += 1
            e = min(g1, ends[i])
            out[pos : pos + e - g0].copy_(leaves[i].reshape(-1)[g0 - starts[i] : e - starts[i]])
            pos, g0 = pos + e - g0, e
    return out


def per_leaf_shard(values: Any, layout: Layout, rank: int, *, dtype: torch.dtype, device) -> torch.Tensor:
    """Rank ``rank``'s ``[S]`` shard of a per-leaf setting: ``values`` is a pytree with the
    layout's structure whose leaves are scalars or tensors broadcastable to each leaf (e.g. a
    weight-decay mask of bools), in ``dtype`` on ``device``. Errors name the leaf."""
    try:
        leaves = layout.treespec.flatten_up_to(values)
    except (ValueError, TypeError) as e:
        raise ValueError(f"mask structure differs from params: {e}") from None
    full = []
    for path, shape, v in zip(layout.paths, layout.shapes, leaves):
        v = torch.as_tensor(v, dtype=dtype, device=device)
        if v.ndim and v.shape != shape:
            raise ValueError(f"mask leaf {path!r} has shape {tuple(v.shape)}, expected {tuple(shape)} or a bool")
        full.append(v.expand(shape))
    return tree_shard(layout.treespec.unflatten(full), layout, rank, dtype=dtype)


def flat_buffer(leaves: list[torch.Tensor], layout: Layout) -> torch.Tensor:
    """The ``[padded_numel]`` buffer that ``leaves`` (the params' leaves, checked against the
    layout) are views of, at their layout offsets; ``ValueError`` if they are not."""
    storage = leaves[0].untyped_storage()
    start = leaves[0].storage_offset() - layout.offsets[0]
    if start < 0 or storage.nbytes() < (start + layout.padded_numel) * leaves[0].element_size() or any(
        x.untyped_storage().data_ptr() != storage.data_ptr() or x.storage_offset() != start + o
        for x, o in zip(leaves, layout.offsets)
    ):
        raise ValueError("params are not views of one flat buffer of this engine's layout (pass what init/step returned)")
    base = leaves[0]._base
    if base is not None and base.shape == (layout.padded_numel,) and base.storage_offset() == start:
        return base
    # e.g. a compiled step's output: the leaves share the buffer but carry no view link
    return leaves[0].new_empty(0).set_(storage, start, (layout.padded_numel,))
