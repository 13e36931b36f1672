"""``Comm``: the static view of one process group that the step needs, held by name.

``Comm`` keeps the group's *name*, never the ``ProcessGroup`` object: the functional collectives
take the name, and the few object-based calls (barrier, ``all_gather_object``) resolve it when
they run (why: ``fzero.comm.teardown``). A ``None`` group, or a world of one, means one process:
no collective is ever called. In eager mode a collective's result is waited on here, before it
leaves this module, and a failure is re-raised naming the collective and the rank.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..flat import split_buckets
from ..layout import Layout
from ..tracing import compiling
from . import arrival
from .collectives import FUNCTIONAL, Collectives, completed, for_backend, sum_received
from .communicator import Communicator, InFlightGather
from .errors import CollectiveError
from .teardown import shutdown_at_exit

__all__ = ["Comm", "resolve_group", "name_of", "group_named"]


def resolve_group(group):
    """``group`` as given, or WORLD when ``None`` and torch.distributed is initialized, else ``None``."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def name_of(group) -> str | None:
    """A ``ProcessGroup``'s name, what a communicator holds (``None`` for ``None``)."""
    return None if group is None else group.group_name


def group_named(name: str):
    """The ``ProcessGroup`` named ``name``, resolved now (off the hot path: barriers, objects)."""
    return dist.distributed_c10d._resolve_process_group(name)


def _gather_what(i: int, layout: Layout) -> str:
    """How an error names bucket ``i``'s all-gather."""
    return f"all_gather of params (bucket {i} of {len(layout.buckets)}, {layout.buckets[i].shard} elements per rank)"


@dataclasses.dataclass(frozen=True)
class Comm(Communicator):
    """A process group (or none), by name, with the rank and size read once at engine init.

    ``requested`` is the name of the group the user gave (``None`` means "WORLD if
    initialized"), kept to notice a world that changed since init. ``collectives`` is the
    table of tensor collectives it issues (``fzero.comm.collectives``: torch's functional
    collectives, or a wrapped table that counts or logs them)."""

    group: str | None  # the process group's name (see the module docstring)
    rank: int
    world_size: int
    requested: str | None = None
    collectives: Collectives = dataclasses.field(default=FUNCTIONAL, kw_only=True, repr=False)

    @classmethod
    def of(cls, requested, *, collectives: Collectives | None = None) -> "Comm":
        """The communicator of ``requested`` (a ProcessGroup; ``None``: WORLD if initialized,
        else one process), issuing ``collectives`` (default: the fastest table for the group's
        backend, ``fzero.comm.collectives.for_backend``)."""
        group = resolve_group(requested)
        if group is None:
            return cls(None, 0, 1, None, collectives=collectives or FUNCTIONAL)
        shutdown_at_exit()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        collectives = collectives or for_backend(dist.get_backend(group), rank, world_size)
        return cls(name_of(group), rank, world_size, name_of(requested), collectives=collectives)

    @property
    def data_parallel_name(self) -> str:
        """A name of this group's set of ranks, the same on each of them (keys in the store)."""
        return str(self.group)

    def process_group(self):
        """The ``ProcessGroup`` object, resolved now (off the hot path: barriers, objects)."""
        return group_named(self.group)

    def arrive(self, what: str, *, timeout: float) -> None:
        """Every rank reaches the collective call ``what`` within ``timeout`` seconds, or every
        waiting rank raises naming the missing ones (``fzero.comm.arrival``). Off the hot path."""
        if self.world_size > 1:
            arrival.arrive(self.group, what, timeout=timeout)

    def check_unchanged(self) -> None:
        """Raise if the group's size changed since init (a layout for N ranks is useless at M),
        e.g. ``group=None`` before ``init_process_group`` and a step after it, or a group
        destroyed since."""
        if self.requested is None:
            group = resolve_group(None)
            now = 1 if group is None else dist.get_world_size(group)
        else:
            try:
                now = dist.get_world_size(group_named(self.requested))
            except (RuntimeError, ValueError, KeyError):
                now = 0
        if now != self.world_size:
            raise ValueError(
                f"process group has {now} ranks but the engine was initialized for {self.world_size}; "
                "re-run engine.init (or load a checkpoint) at the new world size"
            )

    def issue(self, what: Callable[[], str], fn: Callable[..., torch.Tensor], *args, wait: bool = True) -> torch.Tensor:
        """Run one collective ``fn(*args)`` (a function of ``collectives``) and (unless
        ``wait=False``) wait for it; in eager mode a failure (e.g. a dead peer: gloo/NCCL raise
        after the process group's timeout at the latest) is re-raised naming the collective and
        this rank. ``what()`` names the collective; it is only called eager (traced, the
        layout's ints may be symbolic)."""
        if compiling():
            return completed(fn(*args))
        what = what()
        try:
            out = fn(*args)
        except RuntimeError as e:
            raise self._failed(what, e) from e
        return self.wait(out, what) if wait else out

    def wait(self, x: torch.Tensor, what: str = "collective") -> torch.Tensor:
        """Wait for a collective started with ``wait=False``; errors name ``what`` and this rank."""
        try:
            return completed(x)
        except RuntimeError as e:
            raise self._failed(what, e) from e

    def _failed(self, what: str, e: RuntimeError) -> CollectiveError:
        """The error of collective ``what``: this rank, torch's reason, and where the peers are
        if one of them waits in a collective fzero call this rank never made."""
        return CollectiveError(f"fzero: {what} failed on rank {self.rank} of {self.world_size}: {e}."
                               + arrival.elsewhere(self.group))

    def reduce_scatter_bucket(self, x: torch.Tensor, i: int, layout: Layout, *, wait: bool = True,
                              donated: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Bucket ``i``'s ``[N*S_b]`` buffer -> this rank's ``[S_b]`` slice of its sum over ranks.

        ``wait=False`` returns while the collective is in flight (an ``AsyncCollectiveTensor``
        that waits when first used, or explicitly via ``wait``): how backward overlaps it.
        ``donated``: ``x`` may be overwritten (``Collectives.reduce_scatter_donated``).
        ``dtype``: summed in this dtype, wider than ``x``'s (BF16 or FP16 grads in FP32): ``x``
        crosses the wire as it is, in an all-to-all, and this rank sums the N pieces it receives
        in ``dtype`` (``collectives.sum_received``); each element crosses the wire once at 2
        bytes, where a reduce-scatter of an FP32 copy sends 4 (NCCL's ring) and gloo's all-reduce
        of one 8, and no ``[N*S_b]`` FP32 copy is made. With ``wait=False`` the pieces come back
        in flight, and ``wait_reduced(..., dtype=dtype)`` sums them."""
        if self.world_size == 1:
            return x if dtype is None else x.to(dtype)
        what = lambda: f"reduce_scatter of grads (bucket {i} of {len(layout.buckets)}, {x.numel()} elements)"
        if dtype is not None and dtype != x.dtype:
            pieces = self.issue(what, self.collectives.all_to_all, x, None, None, self.group, wait=wait)
            return sum_received(pieces, self.world_size, dtype) if wait else pieces
        fn = self.collectives.reduce_scatter_donated if donated else self.collectives.reduce_scatter
        return self.issue(what, fn, x, "sum", 0, self.group, wait=wait)

    def all_gather_bucket(self, x: torch.Tensor, i: int, layout: Layout) -> torch.Tensor:
        """This rank's ``[S_b]`` slice of bucket ``i`` -> the bucket's ``[N*S_b]`` buffer."""
        if self.world_size == 1:
            return x
        return self.issue(lambda: _gather_what(i, layout), self.collectives.all_gather, x, 0, self.group)

    def all_gather_bucket_into(self, out: torch.Tensor, x: torch.Tensor, i: int, layout: Layout) -> torch.Tensor:
        """``all_gather_bucket`` written into ``out`` (the bucket's ``[N*S_b]`` view of a buffer)."""
        if self.world_size == 1:
            return out.copy_(x)
        return self.issue(lambda: _gather_what(i, layout), self.collectives.all_gather_into, x, out, 0, self.group)

    def start_all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, layout: Layout) -> InFlightGather:
        """``all_gather_into`` left in flight: each bucket's gather into its view of ``out`` is
        issued at once, the last bucket first (buckets fill in reverse leaf order, so the last
        holds the first layers: what a forward needs first), and the result waits for one bucket
        at a time (:class:`InFlightGather`). Eager only. c10d's async ops give one ``Work`` per
        bucket: the functional collectives' registry keys in-flight work by storage, so a wait
        on any view of ``out`` would wait for every bucket. On gloo each rank's slice is a
        broadcast from that rank (``over_all_reduce``'s form); elsewhere one
        ``all_gather_into_tensor`` per bucket."""
        pg, n = self.process_group(), self.world_size
        gloo = n > 1 and dist.get_backend(pg) == "gloo"
        views = split_buckets(out, layout)
        parts = torch.split(shard, [b.shard for b in layout.buckets])
        works: list = [()] * len(layout.buckets)
        for i in reversed(range(len(layout.buckets))):
            try:
                if n == 1:
                    views[i].copy_(parts[i])
                elif gloo:
                    slices = views[i].view(n, -1)
                    slices[self.rank].copy_(parts[i])
                    works[i] = tuple(dist.broadcast(slices[r], dist.get_global_rank(pg, r), group=pg, async_op=True)
                                     for r in range(n))
                else:
                    works[i] = (dist.all_gather_into_tensor(views[i], parts[i], group=pg, async_op=True),)
            except RuntimeError as e:
                raise self._failed(_gather_what(i, layout), e) from e
        return InFlightGather(tuple(works), lambda i: _gather_what(i, layout), self._failed)

    def all_to_all(self, x: torch.Tensor, output_sizes: list[int], input_sizes: list[int]) -> torch.Tensor:
        """``x``, ``input_sizes[r]`` elements for each rank ``r`` of the shard group in turn ->
        what each rank sent this one (``output_sizes[r]`` from rank ``r``), in rank order:
        ``fzero.shard_view`` hands each matrix to the rank that orthogonalizes it, and back."""
        if self.world_size == 1:
            return x
        what = lambda: f"all_to_all of leaves made whole ({x.numel()} elements out, {sum(output_sizes)} in)"
        return self.issue(what, self.collectives.all_to_all, x, list(output_sizes), list(input_sizes), self.group)

    def all_reduce_sum(self, x: torch.Tensor, what: str = "the grad norm and found_inf") -> torch.Tensor:
        """Elementwise sum over ranks of a small tensor (``what``: what it holds, for errors)."""
        if self.world_size == 1:
            return x
        return self.issue(lambda: f"all_reduce of {what}", self.collectives.all_reduce, x, "sum", self.group)

    def broadcast(self, x: torch.Tensor, what: str = "a tensor") -> torch.Tensor:
        """Rank 0's ``x`` on every rank (the group's rank 0; with replicas, see ``HybridComm``):
        a new tensor, ``x`` not modified; ``x`` itself in a world of one. ``what`` names the
        tensor in a failure's message."""
        if self.world_size == 1:
            return x
        return self.issue(lambda: f"broadcast of {what} from rank 0", self.collectives.broadcast, x, 0, self.group)

    def all_gather_object(self, obj) -> list:
        """Off the hot path only (init, errors): pickles ``obj`` to every rank."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.process_group())
        return out

    def time_buckets(self, layout: Layout, wire_dtype: torch.dtype, reduce_dtype: torch.dtype,
                     gather_dtype: torch.dtype, device: torch.device) -> dict[str, list[float]]:
        """Milliseconds of each bucket's reduce-scatter and all-gather, each run alone after a
        barrier on zero buffers of the step's sizes and dtypes, the max over ranks (the same on
        every rank). Off the hot path: it syncs the host, for a metrics log every few steps."""
        if self.world_size == 1:
            return {"reduce_scatter_ms": [], "all_gather_ms": []}
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

        def timed(fn) -> float:
            dist.barrier(group=pg)
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            return (time.perf_counter() - t0) * 1e3

        pg = self.process_group()
        rs, ag = [], []
        # as the step reduces: grads in the wire dtype, summed in reduce_dtype
        for i, b in enumerate(layout.buckets):
            x = torch.zeros(self.world_size * b.shard, dtype=wire_dtype, device=device)
            rs.append(timed(lambda: self.reduce_scatter_bucket(x, i, layout, dtype=reduce_dtype)))
            y = torch.zeros(b.shard, dtype=gather_dtype, device=device)
            ag.append(timed(lambda: self.all_gather_bucket(y, i, layout)))
        t = torch.tensor([rs, ag], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
        return {"reduce_scatter_ms": t[0].tolist(), "all_gather_ms": t[1].tolist()}
