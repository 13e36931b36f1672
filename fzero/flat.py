"""A pytree <-> its flat buffer (``fzero.layout``): copies in (``flatten``), views out
(``unflatten``, ``leaf_views``), and a rank's shard of either.
"""
from __future__ import annotations

import math
from typing import Any

import optree
import torch

from .layout import Layout
from .memory import shared_memory, viewed_buffer
from .tracing import compiling

__all__ = [
    "flatten",
    "flatten_buckets",
    "split_buckets",
    "unflatten",
    "shard_of",
    "tree_shard",
    "leaf_views",
    "tree_leaves",
    "tree_map",
    "concat",
    "per_leaf_shard",
    "flat_buffer",
]


def concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` without the copy when there is one part (one bucket: a view)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def tree_leaves(tree: Any) -> list:
    """``optree.tree_leaves(tree)``. Traced, a tree of fzero's own nodes (``_own_node``) is
    walked here: dynamo interprets optree's walk bytecode by bytecode, a registry lookup per
    node, and the step's walks of its state were a large part of what it traced of a step
    (docs/startup.md). A list of tensors (the stages pass leaves they walked once already) is
    its own leaves."""
    if isinstance(tree, list) and all(isinstance(x, torch.Tensor) for x in tree):
        return tree
    if compiling():
        out: list = []
        if _collect(tree, out):
            return out
    return optree.tree_leaves(tree)


def tree_map(fn, tree: Any, *rest: Any) -> Any:
    """``optree.tree_map(fn, tree, *rest)``; traced, trees of fzero's own nodes of one structure
    are mapped here, as ``tree_leaves`` walks them."""
    if compiling() and _same_own_structure(tree, *rest):
        return _mapped(fn, tree, *rest)
    return optree.tree_map(fn, tree, *rest)


# The walks below are plain loops: traced, each builtin (``all``, a generator) is more bytecode.
def _own_node(x: Any) -> bool:
    """A tuple, a list, or a NamedTuple of fzero's (its states, ``Quantized``): nodes optree
    flattens into their items in order (fzero registers none of them otherwise)."""
    t = type(x)
    return t is tuple or t is list or (issubclass(t, tuple) and hasattr(t, "_fields") and t.__module__.startswith("fzero."))


def _collect(tree: Any, out: list) -> bool:
    """Append ``tree``'s leaves to ``out``; False at a node that is not fzero's own."""
    if isinstance(tree, torch.Tensor):
        out.append(tree)
        return True
    if tree is None:
        return True
    if not _own_node(tree):
        return False
    for child in tree:
        if not _collect(child, out):
            return False
    return True


def _same_own_structure(tree: Any, *rest: Any) -> bool:
    """Whether ``tree`` holds only tensors, ``None`` and fzero's own nodes, and each of ``rest``
    has its structure (else optree walks them, and names any mismatch)."""
    if isinstance(tree, torch.Tensor):
        for r in rest:
            if not isinstance(r, torch.Tensor):
                return False
        return True
    if tree is None:
        for r in rest:
            if r is not None:
                return False
        return True
    if not _own_node(tree):
        return False
    for r in rest:
        if type(r) is not type(tree) or len(r) != len(tree):
            return False
    for children in zip(tree, *rest):
        if not _same_own_structure(*children):
            return False
    return True


def _mapped(fn, tree: Any, *rest: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree, *rest)
    if tree is None:
        return None
    children = [_mapped(fn, *c) for c in zip(tree, *rest)]
    # ``tuple.__new__`` builds a NamedTuple as its ``_make`` does: traced, a few instructions
    # where calling the class is some forty
    return type(tree)(children) if type(tree) is list else tuple.__new__(type(tree), children)


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
    every element against every piece's range (a GPT's backward took markedly longer:
    benchmarks/results/history/e2e.md); traced as ``out.copy_(torch.cat(parts))``, it writes a
    new buffer of the whole size and copies it."""
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


def unflatten(flat: torch.Tensor, layout: Layout, *, like: Any = None, grads_into: torch.Tensor | None = None) -> Any:
    """The pytree whose leaves are *views* into ``flat`` (writes to a leaf write the buffer).

    ``like``: a pytree with the layout's structure to take the structure from. Traced, a
    structure of plain dicts, lists, tuples and ``None`` is built by the layout's generated code
    (``Layout.tree_builder``) and ``like`` is not needed; for any other structure (a NamedTuple,
    a registered class) pass one inside ``torch.compile`` (e.g. the params): dynamo rebuilds
    trees only from structures it traced itself, not from the ``PyTreeSpec`` in the layout.

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
    leaves = leaf_views(flat, layout, grads_into)
    if compiling() and layout.tree_builder is not None:  # traced: the layout's generated builder
        return layout.tree_builder(leaves)
    return optree.tree_unflatten(layout.treespec if like is None else optree.tree_structure(like), leaves)


def _check_grads_into(into: torch.Tensor, flat: torch.Tensor) -> None:
    """``unflatten``'s ``grads_into`` is a buffer like ``flat`` and not ``flat`` itself."""
    got = (tuple(into.shape), into.dtype, into.device)
    if got != (tuple(flat.shape), flat.dtype, flat.device) or into.requires_grad:
        raise ValueError(f"unflatten: grads_into is {got[1]} of shape {got[0]} on {got[2]}"
                         f"{' requiring grad' if into.requires_grad else ''}; it must be a buffer like the flat "
                         f"params: {flat.dtype} of shape {tuple(flat.shape)} on {flat.device}, not requiring grad")
    if compiling():  # data pointers exist on real tensors only, not on the fakes dynamo traces with
        return
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
    buffer = viewed_buffer(leaves, layout.offsets, layout.padded_numel)
    if buffer is None:
        raise ValueError("params are not views of one flat buffer of this engine's layout (pass what init/step returned)")
    return buffer
