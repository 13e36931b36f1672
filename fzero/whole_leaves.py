"""Leaves made whole across the shard group (``ShardContext.whole``, described in
``fzero.shard_view``): which rank computes each leaf (``assign``), and how the two all-to-alls
move a view's elements there and back (``plan_whole``), worked out from the ``Layout`` and the
view's runs on every rank: static Python, the same on every rank.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .layout import Layout

__all__ = ["assign", "segments", "merge_slices", "WholePlan", "plan_whole"]


def _cost(shape: torch.Size) -> int:
    """Multiply-adds of a Newton–Schulz step on an ``[A, B]`` matrix, ``A <= B``: the Gram
    matrix and the product with it, ``2 A^2 B``, and the polynomial's ``A^3`` (1-D and 0-d:
    their element count)."""
    if len(shape) < 2:
        return math.prod(shape)
    a, b = sorted((shape[0], math.prod(shape[1:])))
    return 2 * a * a * b + a ** 3


def assign(shapes: list[torch.Size], ranks: int) -> list[int]:
    """The rank (of ``ranks``) that computes each of ``shapes``: the largest first, each to the
    least loaded rank so far (ties: the lower rank), the same on every rank."""
    load = [0] * ranks
    out = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-_cost(shapes[i]), i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += _cost(shapes[i])
    return out


def segments(positions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges, in order, with adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for a, b in positions:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class WholePlan(NamedTuple):
    """How ``fzero.shard_view.ShardView.whole`` moves one view's elements, worked out once from the layout.

    ``send``: ``(start, stop)`` ranges of this rank's tensor of the view, in the order the
    first all-to-all sends them: grouped by the rank that computes their leaf, each group in
    the tensor's order; ``send_sizes``/``recv_sizes``: elements sent to / received from each
    rank of the shard group. ``gathers``: for each leaf this rank computes, the ranges of what it
    received that make it whole, in the leaf's order. ``back``: ``(leaf, start, stop)`` slices of
    the results, in the order the second all-to-all sends them back (the order received).
    ``out``: this rank's tensor of the view from what comes back, as ranges of it or ``(None,
    n)`` for ``n`` zeros (the root's padding). ``total``: the view's elements over all ranks."""

    send: tuple
    send_sizes: tuple
    recv_sizes: tuple
    gathers: dict
    back: tuple
    out: tuple
    total: int


def plan_whole(everyone: list[tuple], leaves: tuple[int, ...], layout: Layout, me: int, numel: int) -> WholePlan:
    """The ``WholePlan`` of a view of the ``leaves`` (layout indices) of ``layout``: ``everyone[r]``
    its runs on rank ``r`` of the shard group (``fzero.shard_view.Run``s, in the order of rank
    ``r``'s tensor of the view), ``me`` this rank, ``numel`` the elements of this rank's tensor."""
    n = len(everyone)
    owner = dict(zip(leaves, assign([layout.shapes[i] for i in leaves], n)))
    send = [[r for r in everyone[me] if owner[r.leaf] == o] for o in range(n)]
    recv = [[r for r in everyone[s] if owner[r.leaf] == me] for s in range(n)]
    parts: dict[int, list] = {i: [] for i in sorted((i for i in leaves if owner[i] == me),
                                                    key=lambda i: layout.offsets[i])}
    back, pos = [], 0
    for runs in recv:
        for r in runs:
            parts[r.leaf].append((r.start, pos, r.length))
            back.append((r.leaf, r.start, r.start + r.length))
            pos += r.length
    at, pos = {}, 0  # where each of my runs comes back, in the second all-to-all's result
    for runs in send:
        for r in runs:
            at[r.shard_at], pos = pos, pos + r.length
    out, end = [], 0
    for r in everyone[me]:
        if r.shard_at > end:
            out.append((None, r.shard_at - end))  # the root's padding
        out.append((at[r.shard_at], at[r.shard_at] + r.length))
        end = r.shard_at + r.length
    if numel > end:
        out.append((None, numel - end))
    return WholePlan(
        send=tuple(segments([(r.shard_at, r.shard_at + r.length) for runs in send for r in runs])),
        send_sizes=tuple(sum(r.length for r in runs) for runs in send),
        recv_sizes=tuple(sum(r.length for r in runs) for runs in recv),
        gathers={i: tuple(segments([(p, p + k) for _, p, k in sorted(ps)])) for i, ps in parts.items()},
        back=tuple(merge_slices(back)), out=tuple(_merge_ranges(out)),
        total=sum(sum(r.length for r in runs) for runs in everyone))


def merge_slices(pieces: list[tuple]) -> list[tuple]:
    """``(key, start, stop)`` slices (of a leaf's result, of a group's tensor) with adjacent
    slices of one key merged; ``(None, 0, n)`` zeros are never adjacent where it is used."""
    out: list[tuple] = []
    for leaf, a, b in pieces:
        if out and out[-1][0] == leaf and out[-1][2] == a:
            out[-1] = (leaf, out[-1][1], b)
        else:
            out.append((leaf, a, b))
    return out


def _merge_ranges(pieces: list[tuple]) -> list[tuple]:
    """``(start, stop)`` ranges of one tensor and ``(None, n)`` runs of zeros, adjacent ones merged."""
    out: list[tuple] = []
    for a, b in pieces:
        if out and a is not None and out[-1][0] is not None and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif out and a is None and out[-1][0] is None:
            out[-1] = (None, out[-1][1] + b)
        else:
            out.append((a, b))
    return out
