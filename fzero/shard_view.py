"""The ``ShardContext`` the engine gives a transform: which leaf each element of a rank's
``[S]`` shard belongs to, groups of leaves compacted (``transforms.partition``), and leaves made
whole through the communicator (Muon's Newton–Schulz).

A view's tensor is the rank's shard itself (the root view) or, after ``split``, one group's
elements of its parent's tensor, compacted in their order. Either way it is a sequence of
*runs*, each a piece of one leaf, and the view knows them: which leaf, where in the leaf, where
in the tensor. Everything here is static Python worked out from the ``Layout`` (nothing is
stored in the state): a transform that asks for ``split`` at every update gets the same one.

``whole(x, fn)``: each leaf made whole on the rank of the shard group that computes it (the
leaves divided among the ranks greedily by cost: the largest first, each to the least loaded
rank, the longest-processing-time rule), ``fn`` applied there, and every rank's slice handed
back -- Dion's division of the work (microsoft/dion), with two all-to-alls:

    x (this view's tensor) -> all-to-all: each rank sends each piece to the rank computing its
    leaf -> fn on this rank's leaves, whole -> all-to-all: each piece back where it came from

Each element crosses the wire at most once each way (in ``x``'s dtype, then in ``fn``'s), only
to the one rank that needs it: a rank sends and receives about its own share, ``P_view / N``
elements (less the pieces of leaves it computes itself), where an all-gather would bring every
rank ``(N-1)/N`` of all ``P_view``. The result is bit for bit what one process computes. On a
hybrid mesh each replica's shard group does the same (the replicas hold the same values).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import optree
import torch
import torch.nn.functional as F

from fzero.transforms import ShardContext, Split

from .flat import concat, per_leaf_shard
from .layout import Layout
from .whole_leaves import WholePlan, merge_slices, plan_whole, segments

__all__ = ["Run", "ShardView", "leaf_runs", "bind"]


class Run(NamedTuple):
    """``length`` elements of leaf ``leaf`` (its index in the layout) from element ``start``
    of the flattened leaf: ``shard[shard_at : shard_at + length]`` of the rank's ``[S]`` shard."""

    leaf: int
    start: int
    shard_at: int
    length: int


def leaf_runs(layout: Layout, rank: int) -> tuple[Run, ...]:
    """The runs of rank ``rank``'s ``[S]`` shard, in shard order (padding is in none)."""
    runs, pos = [], 0
    for bucket, (lo, hi) in zip(layout.buckets, layout.shard_ranges(rank)):
        for i in bucket.leaves:
            a = layout.offsets[i]
            s, e = max(a, lo), min(a + math.prod(layout.shapes[i]), hi)
            if s < e:
                runs.append(Run(i, s - a, pos + s - lo, e - s))
        pos += hi - lo
    return tuple(sorted(runs, key=lambda r: r.shard_at))


class _Geometry(NamedTuple):
    """What every view of one rank's shard shares."""

    layout: Layout
    comm: Any  # fzero.comm communicator: moves each leaf's pieces to the rank computing it and back
    device: torch.device  # where the collectives run (the params' device)
    rank: int


class ShardView(ShardContext):
    """A ``ShardContext`` over a view's tensor. ``leaves``: the layout indices of the leaves of
    ``tree``, in its leaf order; ``runs_of(rank)``: the view's runs on that rank of the shard
    group, each a ``Run`` whose ``shard_at`` is replaced by where it starts in that rank's
    tensor of the view, in order; ``runs``/``numel``: this rank's. ``parent``/``segments``:
    where this view's tensor lies in its parent's, as ``(start, stop)`` ranges of the parent's
    tensor (``None`` and ``()`` for the root). ``slot``: each leaf's index in ``leaves``."""

    def __init__(self, tree: Any, geometry: _Geometry, leaves: tuple[int, ...], parent: "ShardView | None" = None):
        super().__init__(tree, self._to_shard)
        self.geometry, self.leaves, self.parent = geometry, leaves, parent
        self.slot = {leaf: j for j, leaf in enumerate(leaves)}
        self._runs: dict[int, tuple[Run, ...]] = {}
        self._splits: dict[Callable, Split] = {}
        self._plan = None
        self.runs = self.runs_of(geometry.rank)
        self.numel = geometry.layout.shard_numel if parent is None else sum(r.length for r in self.runs)
        members = set(leaves)
        self.segments = () if parent is None else tuple(segments(
            [(r.shard_at, r.shard_at + r.length) for r in parent.runs if r.leaf in members]))

    @classmethod
    def root(cls, tree: Any, layout: Layout, comm, device: torch.device) -> "ShardView":
        """The view of ``comm.rank``'s ``[S]`` shard of ``layout`` (``tree``: the params or
        placeholders of their shapes)."""
        return cls(tree, _Geometry(layout, comm, device, comm.rank), tuple(range(len(layout.shapes))))

    def runs_of(self, rank: int) -> tuple[Run, ...]:
        """This view's runs on ``rank`` of the shard group (see the class docstring)."""
        if rank not in self._runs:
            if self.parent is None:
                self._runs[rank] = leaf_runs(self.geometry.layout, rank)
            else:
                members, runs, at = set(self.leaves), [], 0
                for r in self.parent.runs_of(rank):
                    if r.leaf in members:
                        runs.append(r._replace(shard_at=at))
                        at += r.length
                self._runs[rank] = tuple(runs)
        return self._runs[rank]

    # ------------------------------------------------------------------ masks
    def _to_shard(self, per_leaf: Any) -> torch.Tensor:
        g = self.geometry
        if self.parent is None:
            return per_leaf_shard(per_leaf, g.layout, g.rank, dtype=torch.bool, device=g.device)
        values = optree.tree_leaves(per_leaf)
        if len(values) != len(self.leaves):
            raise ValueError(f"a per-leaf setting of a group of {len(self.leaves)} leaves has {len(values)} values")
        mine = dict(zip(self.leaves, values))
        full = self.parent.tree_of([mine.get(i, False) for i in self.parent.leaves])
        return self.take_from_parent(self.parent.to_shard(full))

    def tree_of(self, leaf_values: list) -> Any:
        """A pytree like ``tree`` with these values at its leaves, in leaf order."""
        return optree.tree_structure(self.tree).unflatten(leaf_values)

    # ------------------------------------------------------------------ groups
    def split(self, labels_of) -> Split:
        """See ``ShardContext.split``. Worked out once per ``labels_of`` (a later call with it
        returns the same ``Split``): compiled, a step traces a dict lookup, not the labels."""
        if labels_of not in self._splits:
            self._splits[labels_of] = self._split(tuple(labels_of(self.tree)))
        return self._splits[labels_of]

    def _split(self, labels: tuple) -> Split:
        if len(labels) != len(self.leaves):
            raise ValueError(f"split: {len(labels)} labels for {len(self.leaves)} leaves")
        label_of = dict(zip(self.leaves, labels))
        spec = optree.tree_structure(self.tree)
        flat_tree = optree.tree_leaves(self.tree)
        parts = {}
        for k in dict.fromkeys(labels):
            tree = spec.unflatten([x if t == k else None for x, t in zip(flat_tree, labels)])
            parts[k] = ShardView(tree, self.geometry, tuple(i for i, t in zip(self.leaves, labels) if t == k), self)
        at = {k: 0 for k in parts}
        order = []  # (start, stop) in this view's tensor, label, start in the part
        for r in self.runs:
            k = label_of[r.leaf]
            order.append((r.shard_at, r.shard_at + r.length, k, at[k]))
            at[k] += r.length
        pieces = self._join_pieces(order)

        def take(x: torch.Tensor) -> dict:
            return {k: v.take_from_parent(x) for k, v in parts.items()}

        def join(values: dict) -> torch.Tensor:
            return self._join(pieces, values)

        return Split(parts, take, join)

    def prepare(self) -> "ShardView":
        """Work out now, eagerly, ``whole``'s plan for this view and every group split from it
        (``engine.init`` calls it for a transform that ``needs_context``, after the transform's
        ``init`` made its splits): worked out inside a compiled step instead, a plan would be
        traced once as missing and once more as present (a recompile). Returns the view."""
        self._whole_plan()
        for split in self._splits.values():
            for part in split.parts.values():
                part.prepare()
        return self

    def only_split(self) -> Split:
        """The one ``Split`` made of this view (a ``partition``'s); ``ValueError`` for none or
        several (two partitions side by side), which nothing maps to a checkpoint yet."""
        if len(self._splits) != 1:
            raise ValueError(f"the state has {len(self._splits)} groupings of one shard by leaf (transforms.partition); "
                             "checkpoints map exactly one per level")
        return next(iter(self._splits.values()))

    def take_from_parent(self, x: torch.Tensor) -> torch.Tensor:
        """This view's tensor out of its parent's ``x``."""
        if not self.segments:
            return x[:0]
        return concat([x[a:b] for a, b in self.segments])

    def _join_pieces(self, order: list) -> list[tuple]:
        """How to assemble this view's tensor from its parts: ``(label, start, stop)`` slices of
        a part, or ``(None, 0, n)`` for ``n`` zeros (padding), in order, adjacent slices of one
        part merged."""
        pieces, pos = [], 0
        for a, b, k, at in order:
            if a > pos:
                pieces.append((None, 0, a - pos))
            pieces.append((k, at, at + b - a))
            pos = b
        if self.numel > pos:
            pieces.append((None, 0, self.numel - pos))
        return merge_slices(pieces)

    @staticmethod
    def _join(pieces: list[tuple], values: dict) -> torch.Tensor:
        some = next(iter(values.values()))
        parts = [values[k][a:b] if k is not None else some.new_zeros(b) for k, a, b in pieces]
        return concat(parts) if parts else some[:0]

    # ------------------------------------------------------------------ whole leaves
    def whole(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], *, dtype=None) -> torch.Tensor:
        """See ``ShardContext.whole`` and the module docstring. Every rank of the shard group
        must call it (two all-to-alls), with the same ``fn``."""
        g = self.geometry
        dtype = x.dtype if dtype is None else dtype
        plan = self._whole_plan()
        if not plan.total:  # no element of these leaves on any rank
            return torch.zeros(self.numel, dtype=dtype, device=x.device)
        device = g.device
        # my elements, grouped by the rank that computes them (none: this rank holds none of them)
        sent = concat([x[a:b] for a, b in plan.send] or [x[:0]]).to(device)
        got = g.comm.all_to_all(sent, plan.recv_sizes, plan.send_sizes)  # the pieces of the leaves I compute
        done = {leaf: fn(concat([got[a:b] for a, b in parts]).view(g.layout.shapes[leaf])).reshape(-1).to(dtype)
                for leaf, parts in plan.gathers.items()}
        back = concat([done[leaf][a:b] for leaf, a, b in plan.back]) if plan.back else got.new_zeros(0, dtype=dtype)
        mine = g.comm.all_to_all(back, plan.send_sizes, plan.recv_sizes)  # my elements' results, as I sent them
        out = concat([mine[a:b] if a is not None else torch.zeros(b, dtype=dtype, device=device) for a, b in plan.out]
                     or [mine[:0]])
        return out.to(x.device)

    # ------------------------------------------------------------------ per-leaf norms
    def leaf_norms(self, *xs: torch.Tensor, rms: bool = False) -> tuple[torch.Tensor, ...]:
        """See ``ShardContext.leaf_norms``. Each run's sum of squares on this rank, one
        all-reduce of the ``[len(xs), leaves]`` sums over the shard group (every rank of it must
        call it), and each leaf's norm (``rms``: its norm over the square root of its size)
        spread over its run (compiled, the spread fuses into whatever reads it)."""
        g, slot = self.geometry, self.slot
        sums = [xs[0].new_zeros(len(xs), dtype=torch.float32)] * len(self.leaves)
        for r in self.runs:
            parts = [x[r.shard_at:r.shard_at + r.length].float().square().sum() for x in xs]
            if rms:  # the mean of the squares: each rank's part over the leaf's size (a Python number)
                parts = [s / math.prod(g.layout.shapes[r.leaf]) for s in parts]
            sums[slot[r.leaf]] = torch.stack(parts)
        if not sums:
            return tuple(torch.zeros(self.numel, dtype=torch.float32, device=x.device) for x in xs)
        total = g.comm.all_reduce_sum(torch.stack(sums, 1).to(g.device), "the per-leaf sums of squares")
        norms = total.sqrt().to(xs[0].device)
        pieces, pos = [], 0
        for r in self.runs:
            if r.shard_at > pos:
                pieces.append(norms.new_zeros(len(xs), r.shard_at - pos))
            j = slot[r.leaf]
            pieces.append(norms[:, j:j + 1].expand(len(xs), r.length))
            pos = r.shard_at + r.length
        if self.numel > pos:
            pieces.append(norms.new_zeros(len(xs), self.numel - pos))
        return tuple(torch.cat(pieces, 1).unbind(0)) if pieces else tuple(norms.new_zeros(0) for _ in xs)

    # ------------------------------------------------------------------ factored statistics
    def _matrices(self) -> list[tuple[int, int, torch.Size]]:
        """``(slot, leaf, shape)`` of each leaf of the view with 2 or more dims, in leaf order."""
        shapes = self.geometry.layout.shapes
        return [(j, leaf, shapes[leaf]) for j, leaf in enumerate(self.leaves) if len(shapes[leaf]) >= 2]

    def matrix_means(self, x: torch.Tensor) -> list:
        """See ``ShardContext.matrix_means``. Per run of a matrix leaf: its elements padded to
        whole rows (``[rows, C]``), summed along the rows and the columns into the leaf's
        ``[B*R]`` and ``[B, C]`` sums (``B``: the product of the leading dims); then one all-reduce
        of every matrix's sums over the shard group (every rank of it must call it), divided by
        ``C`` and ``R``."""
        g = self.geometry
        mats = self._matrices()
        out: list = [None] * len(self.leaves)
        if not mats:
            return out
        x = x.float()
        by_leaf: dict[int, list[Run]] = {}
        for r in self.runs:
            by_leaf.setdefault(r.leaf, []).append(r)
        sums = []
        for _, leaf, shape in mats:
            R, C, B = shape[-2], shape[-1], math.prod(shape[:-2])
            rows, cols = x.new_zeros(B * R), x.new_zeros(B, C)
            for r in by_leaf.get(leaf, ()):
                q0, q1, a, b0, b1 = _row_span(r, R, C)
                block = F.pad(x[r.shard_at:r.shard_at + r.length], (a, (q1 - q0) * C - a - r.length)).view(q1 - q0, C)
                rows = rows + F.pad(block.sum(1), (q0, B * R - q1))
                if b1 - b0 == 1:  # the rows of one matrix (always, for a 2-dim leaf)
                    cols = cols + F.pad(block.sum(0, keepdim=True), (0, 0, b0, B - b1))
                else:
                    cols = cols.index_add(0, torch.arange(q0, q1, device=x.device) // R, block)
            sums += [rows, cols.reshape(-1)]
        total = g.comm.all_reduce_sum(torch.cat(sums).to(g.device), "the matrices' row and column sums").to(x.device)
        pos = 0
        for j, _, shape in mats:
            R, C, B = shape[-2], shape[-1], math.prod(shape[:-2])
            out[j] = (total[pos:pos + B * R].view(*shape[:-1], 1) / C,
                      total[pos + B * R:pos + B * (R + C)].view(*shape[:-2], 1, C) / R)
            pos += B * (R + C)
        return out

    def outer(self, factors: list) -> torch.Tensor:
        """See ``ShardContext.outer``. Per run of a matrix leaf the rows it touches of
        ``row * col`` (``[rows, C]``), cut to the run: no rank forms a whole leaf it holds a part of."""
        shapes, slot = self.geometry.layout.shapes, self.slot
        some = next((f[0] for f in factors if f is not None), None)
        if some is None:
            raise ValueError("outer: no factors (the view holds no leaf of 2 or more dims)")
        pieces, pos = [], 0
        for r in self.runs:
            if r.shard_at > pos:
                pieces.append(some.new_zeros(r.shard_at - pos))
            f = factors[slot[r.leaf]]
            if f is None:
                pieces.append(some.new_zeros(r.length))
            else:
                shape = shapes[r.leaf]
                R, C = shape[-2], shape[-1]
                q0, q1, a, b0, b1 = _row_span(r, R, C)
                rows, cols = f[0].reshape(-1)[q0:q1].unsqueeze(1), f[1].reshape(-1, C)
                cols = cols[b0:b1] if b1 - b0 == 1 else cols.index_select(
                    0, torch.arange(q0, q1, device=cols.device) // R)
                pieces.append((rows * cols).reshape(-1)[a:a + r.length])
            pos = r.shard_at + r.length
        if self.numel > pos:
            pieces.append(some.new_zeros(self.numel - pos))
        return concat(pieces) if pieces else some.new_zeros(0)

    def _whole_plan(self) -> WholePlan:
        """``whole``'s plan, worked out once (see ``fzero.whole_leaves.WholePlan``)."""
        if self._plan is None:
            g = self.geometry
            everyone = [self.runs_of(r) for r in range(g.comm.world_size)]
            self._plan = plan_whole(everyone, self.leaves, g.layout, g.rank, self.numel)
        return self._plan


def _row_span(r: Run, R: int, C: int) -> tuple[int, int, int, int, int]:
    """Where run ``r`` lies in its leaf of ``[..., R, C]`` elements: the rows of ``C`` elements
    (of the flattened leaf) it touches, ``[q0, q1)``; where it starts in the first, element ``a``
    of ``[q0 * C, q1 * C)``; the matrices of ``R`` rows those rows lie in, ``[b0, b1)``."""
    q0, q1 = r.start // C, (r.start + r.length - 1) // C + 1
    return q0, q1, r.start - q0 * C, q0 // R, (q1 - 1) // R + 1


def bind(tx, context: ShardContext):
    """``tx`` whose ``update`` gets ``context=context`` (a transform that ``needs_context``;
    others are returned as they are)."""
    if not tx.needs_context:
        return tx

    def update(updates, state, params=None, **extra):
        return tx.update(updates, state, params, context=context, **extra)

    return tx._replace(update=update)
