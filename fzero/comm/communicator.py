"""The interface every communicator shares, and what it builds on its primitives.

A communicator provides ``reduce_scatter_bucket``, ``all_gather_bucket`` (and
``all_gather_bucket_into``, the same into a given buffer), ``all_to_all`` (``fzero.shard_view``'s
whole leaves), ``all_reduce_sum``,
``broadcast`` (rank 0's tensor of the whole data-parallel world), ``all_gather_object``, ``wait``, ``arrive``, ``check_unchanged`` and ``time_buckets``; this base
adds the averaging reduce-scatter (``reduce_scatter_mean``, ``start_mean``: FSDP's pre/post split
of the 1/N hidden behind ``mean_factor``), the gather of a whole shard, and the cross-rank
agreement check. ``rank`` and ``world_size`` are always the shard group's: what the layout is
built for. Each collective is one call per bucket, never per leaf.
"""
from __future__ import annotations

import hashlib
import json
from typing import Callable, ClassVar, NamedTuple

import torch

from ..flat import concat, split_buckets, tree_shard
from ..layout import Layout
from .collectives import sum_received
from .errors import ranks_text

__all__ = ["Communicator", "InFlightGather", "predivide_factor"]


def predivide_factor(world_size: int) -> float:
    """FSDP's split of the 1/N average for low-precision sums: inputs are divided by ``f``
    (about sqrt(N), a power of two) before the reduction and the result by ``N/f`` after, so
    neither the sum of N scaled grads overflows nor the pre-divided inputs underflow."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)


class InFlightGather(NamedTuple):
    """The per-bucket ``Work`` of ``Comm.start_all_gather_into``; ``wait(i)`` returns once bucket
    ``i`` is in place, raising the communicator's ``CollectiveError`` naming it if it failed."""

    works: tuple  # per bucket: c10d Work objects (none where nothing was sent)
    what: Callable[[int], str]  # how an error names bucket i (made only on a failure)
    failed: Callable[[str, RuntimeError], Exception]

    def wait(self, i: int) -> None:
        try:
            for work in self.works[i]:
                work.wait()
        except RuntimeError as e:
            raise self.failed(self.what(i), e) from e

    def wait_all(self) -> None:
        for i in reversed(range(len(self.works))):  # in issue order
            self.wait(i)


class Communicator:
    """What every communicator shares, built on its three primitives (``reduce_scatter_bucket``,
    ``all_gather_bucket``, ``all_reduce_sum``) and ``all_gather_object``: the averaging
    reduce-scatter, the gather of a whole shard, the cross-rank agreement check."""

    rank: int  # in the shard group: the layout's rank
    world_size: int  # ranks the state is sharded over: the layout's N
    replica: ClassVar[int] = 0  # which copy of the shards this rank holds (hybrid: the replicate index)
    replicas: ClassVar[int] = 1  # copies of the shards (hybrid: the replicate group's size)
    simulated: ClassVar[bool] = False

    @property
    def data_parallel(self) -> int:
        """Ranks that feed grads into one update: shards x replicas (1: nothing to reduce)."""
        return self.world_size * self.replicas

    def mean_factor(self, dtype: torch.dtype) -> float:
        """``f`` with ``mean over ranks = f * (what reduce_scatter_mean returns)`` for a sum in
        ``dtype``: ``1/N`` for FP32 (N = every data-parallel rank, replicas included); ``pre/N``
        for a low-precision sum, whose inputs are first divided by ``pre`` (FSDP's split of the
        1/N, see ``predivide_factor``)."""
        return self._pre(dtype) / self.data_parallel

    def _pre(self, dtype: torch.dtype) -> float:
        low = self.data_parallel > 1 and dtype != torch.float32
        return predivide_factor(self.data_parallel) if low else 1.0

    def wait_reduced(self, x: torch.Tensor, i: int, layout: Layout, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Finish bucket ``i``'s reduce started with ``start_mean(..., wait=False)``, given the
        same ``dtype``: grads narrower than it arrive as the N pieces of an all-to-all, summed
        here (``reduce_scatter_bucket``)."""
        x = self.wait(x, f"reduce_scatter of grads (bucket {i} of {len(layout.buckets)})")
        return x if dtype is None or dtype == x.dtype else sum_received(x, self.world_size, dtype)

    def first_rank_shard(self, tree, layout: Layout, *, what: str) -> torch.Tensor:
        """This rank's ``[S]`` FP32 shard of rank 0's ``tree`` (rank 0 of the whole data-parallel
        world: replica 0, shard 0), as DDP broadcasts rank 0's params when it is built: ranks
        that start from other values (a seed per rank, pretrained weights loaded on rank 0 only)
        all train rank 0's, never a patchwork of every rank's own shard. One broadcast of each
        rank's ``[S]`` shard in turn (rank 0 builds it from its leaves, ``S`` elements at a time:
        ``fzero.flat.tree_shard``), ``4P`` bytes received per rank, like DDP's; none at one rank.
        ``what`` names the tree in a failure's message. Off the hot path (``init``)."""
        if self.data_parallel == 1 or self.simulated:  # a simulated world holds identical tensors
            return tree_shard(tree, layout, self.rank, dtype=torch.float32)
        device, mine = layout.treespec.flatten_up_to(tree)[0].device, None
        for r in range(self.world_size):
            if self.rank == 0:  # shard 0 of every replica builds it; the broadcast keeps replica 0's
                src = tree_shard(tree, layout, r, dtype=torch.float32)
            else:
                src = torch.empty(layout.shard_numel, dtype=torch.float32, device=device)
            got = self.broadcast(src, f"rank 0's {what}, shard {r} of {self.world_size}")
            mine = got if r == self.rank else mine
        return mine

    def start_mean(self, x: torch.Tensor, i: int, layout: Layout, *, wait: bool = True,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """Bucket ``i``'s ``[N*S_b]`` grads (a buffer the caller gives up: pre-divided in place)
        -> this rank's ``[S_b]`` partial mean, summed in ``dtype`` (default: ``x``'s); scale by
        ``mean_factor(dtype)`` to finish it. ``wait=False``: returns while the collective is in
        flight; ``wait_reduced`` (with the same ``dtype``) finishes it."""
        pre = self._pre(dtype or x.dtype)
        return self.reduce_scatter_bucket(x if pre == 1.0 else x.div_(pre), i, layout, wait=wait, dtype=dtype)

    def reduce_scatter_mean(self, buckets: list[torch.Tensor], layout: Layout, *, donated: bool = False,
                            dtype: torch.dtype | None = None) -> tuple[torch.Tensor, float]:
        """Per-bucket ``[N*S_b]`` grads of this rank -> ``(partial, factor)``: ``partial * factor``
        is this rank's ``[S]`` shard of their mean over ranks. The factor is left to the caller so
        that it joins the step's one FP32 multiply (unscale, micro-batches). ``donated``: the
        buckets may be overwritten (pre-divided and reduced in place), else they are not modified.
        ``dtype``: the sum's dtype where it is wider than the buckets' (BF16 or FP16 grads summed
        in FP32, ``reduce_scatter_bucket``); the partial comes back in it.

        Summing N scaled FP16 grads can overflow by itself: an FP32 sum cannot; a sum in FP16/BF16
        divides its inputs by ``pre`` ~ sqrt(N) first (``predivide_factor``)."""
        dtype = dtype or buckets[0].dtype
        pre = self._pre(dtype)
        if pre != 1.0:
            buckets = [x.div_(pre) if donated else x / pre for x in buckets]
        parts = [self.reduce_scatter_bucket(x, i, layout, donated=donated, dtype=dtype) for i, x in enumerate(buckets)]
        return concat(parts), self.mean_factor(dtype)

    def all_gather(self, shard: torch.Tensor, layout: Layout) -> torch.Tensor:
        """This rank's ``[S]`` shard -> the ``[padded_numel]`` buffer of every rank's shard."""
        if self.world_size == 1:
            return shard
        parts, pos = [], 0
        for i, b in enumerate(layout.buckets):
            parts.append(self.all_gather_bucket(shard[pos : pos + b.shard], i, layout))
            pos += b.shard
        return concat(parts)

    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, layout: Layout) -> torch.Tensor:
        """``all_gather`` written into ``out``, a ``[padded_numel]`` buffer (the params' own,
        with ``donate``): no new buffer, and on gloo no copy (each shard is broadcast into its
        slice). Returns ``out``."""
        pos = 0
        for i, (b, view) in enumerate(zip(layout.buckets, split_buckets(out, layout))):
            self.all_gather_bucket_into(view, shard[pos : pos + b.shard], i, layout)
            pos += b.shard
        return out

    def start_all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, layout: Layout) -> InFlightGather:
        """``all_gather_into``, whose result waits for one bucket at a time; here complete on
        return (``Comm`` leaves it in flight)."""
        self.all_gather_into(out, shard, layout)
        nothing = ((),) * len(layout.buckets)  # no Work to wait for: nothing can fail
        return InFlightGather(nothing, lambda i: f"bucket {i}", lambda what, e: e)

    def check_same(self, what: str, table: dict[str, str]) -> None:
        """Raise the same ``ValueError`` on every rank unless all ranks pass an equal ``table``
        (setting -> printable value); the message names each differing setting with its value
        on each rank. Off the hot path (``init``): one all-gather of a digest, and only on a
        mismatch a second one of the tables. No other collective runs before it returns, so
        ranks that disagree (e.g. on a dtype) never meet in a collective that would mix them."""
        digest = hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()
        if len(set(self.all_gather_object(digest))) == 1:
            return
        tables = self.all_gather_object(table)
        keys = list(dict.fromkeys(k for t in tables for k in t))
        diffs = []
        for key in keys:
            ranks_of: dict[str, list[int]] = {}
            for rank, t in enumerate(tables):
                ranks_of.setdefault(t.get(key, "absent"), []).append(rank)
            if len(ranks_of) > 1:
                diffs.append(f"{key} is " + " but ".join(f"{v} on {ranks_text(r)}" for v, r in ranks_of.items()))
        more = f"; and {len(diffs) - 4} more" if len(diffs) > 4 else ""
        raise ValueError(f"{what} differs across ranks: " + "; ".join(diffs[:4]) + more)
