"""The tensor collectives a communicator issues, as one public table: the seam for counting.

``FUNCTIONAL`` holds torch's *functional* collectives (``torch.distributed._functional_collectives``):
they return new tensors instead of mutating, so the step stays pure and ``torch.compile`` traces
them into the graph (``fullgraph=True``). A ``Comm`` calls them through its ``collectives``
table (``Comm.of(group, collectives=...)``), so a test or benchmark that counts, logs or wraps
every call passes ``FUNCTIONAL.wrapped(...)`` instead of patching anything: the default path is
one attribute lookup more than calling the functions directly, with no host sync and nothing a
trace cannot follow.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed._functional_collectives as funcol

from ..tracing import compiling

__all__ = ["Collectives", "FUNCTIONAL", "all_reduce_in_place", "broadcast_in_place", "completed",
           "for_backend", "over_all_reduce", "sum_received"]


class Collectives(NamedTuple):
    """One function per tensor collective, each with its functional-collective signature (the
    group given by name, the result a new tensor, possibly still in flight):

    * ``reduce_scatter(x, op, dim, group)`` -> this rank's slice of the reduction of ``x``
    * ``all_gather(x, dim, group)`` -> every rank's ``x``, concatenated along ``dim``
    * ``all_reduce(x, op, group)`` -> the reduction of ``x`` over the group
    * ``broadcast(x, src, group)`` -> rank ``src``'s ``x``
    * ``reduce_scatter_donated(x, op, dim, group)`` -> ``reduce_scatter``'s result, from a
      buffer the caller gives up: it may be overwritten (reduced in place, no copy of it)
    * ``all_gather_into(x, out, dim, group)`` -> ``out``, overwritten with ``all_gather``'s
      result (written in place where the backend allows: no new buffer)
    * ``all_to_all(x, output_split_sizes, input_split_sizes, group)`` -> the pieces every rank
      sent this one, concatenated in rank order (``x`` holds one piece for each rank, in order)

    The input tensor is always the first argument and the group's name the last.
    ``all_gather_into`` returns its result complete (nothing in flight). Low-precision grads
    summed in FP32 are an ``all_to_all`` and a local sum (``Comm.reduce_scatter_bucket``,
    :func:`sum_received`), on every backend."""

    reduce_scatter: Callable[..., torch.Tensor]
    all_gather: Callable[..., torch.Tensor]
    all_reduce: Callable[..., torch.Tensor]
    broadcast: Callable[..., torch.Tensor]
    reduce_scatter_donated: Callable[..., torch.Tensor]
    all_gather_into: Callable[..., torch.Tensor]
    all_to_all: Callable[..., torch.Tensor]

    def wrapped(self, wrap: Callable[[str, Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]) -> "Collectives":
        """The table whose collective ``name`` is ``wrap(name, this table's function)``, e.g. one
        that counts calls and bytes before calling through. A wrapper that runs under
        ``torch.compile`` is traced like the rest of the step: Python side effects there happen
        at trace time (``torch.compiler.is_compiling()`` tells)."""
        return Collectives(*(wrap(name, fn) for name, fn in zip(self._fields, self)))


# torch >= 2.5 renamed the single-tensor collectives; same signature and semantics.
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _copy_of_all_gather(x: torch.Tensor, out: torch.Tensor, dim: int, group) -> torch.Tensor:
    return out.copy_(completed(_all_gather(x, dim, group)))


FUNCTIONAL = Collectives(
    reduce_scatter=_reduce_scatter,
    all_gather=_all_gather,
    all_reduce=funcol.all_reduce,
    broadcast=funcol.broadcast,
    # a reduce-scatter reads its input without copying it, whoever owns it
    reduce_scatter_donated=_reduce_scatter,
    all_gather_into=_copy_of_all_gather,
    all_to_all=funcol.all_to_all_single,
)


def all_reduce_in_place(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    """``x`` overwritten with its reduction over the group (named ``group``), complete. Eager:
    the functional collectives' in-place form. Traced, the functional all-reduce copied back
    into ``x`` (the in-place form cannot be functionalized): on a graph input inductor's
    reinplacing pass turns that into the in-place collective on the input's own buffer."""
    if compiling():
        return x.copy_(completed(funcol.all_reduce(x, op, group)))
    return funcol.wait_tensor(torch.ops._c10d_functional.all_reduce_(x, op.lower(), group))


def broadcast_in_place(x: torch.Tensor, src: int, group: str) -> torch.Tensor:
    """``x`` overwritten with rank ``src``'s ``x`` (a view may be given: it is written through),
    complete: the functional collectives' in-place form, eager only (it cannot be
    functionalized; traced, it runs inside ``_broadcast_shards_into_op``)."""
    return funcol.wait_tensor(torch.ops._c10d_functional.broadcast_(x, src, group))


def over_all_reduce(rank: int, world_size: int, base: Collectives = FUNCTIONAL) -> Collectives:
    """``base`` with reduce-scatter and all-gather built from its all-reduce and broadcast, for
    rank ``rank`` of ``world_size`` (the shard group it is issued in):

    * reduce-scatter = the all-reduce of the whole ``[N*S]`` buffer, then this rank's ``[S]``
      slice of it (a view, taken without waiting: the collective stays in flight);
    * all-gather = N broadcasts, rank ``i``'s ``[S]`` shard from rank ``i``, concatenated;
    * the donated reduce-scatter reduces the buffer in place (no ``[N*S]`` copy of it), and
      ``all_gather_into`` broadcasts each shard into its own slice of ``out``.

    Why: gloo's own reduce-scatter and all-gather take longer than these on the same bytes
    (``benchmarks/collectives.py``; the figures: docs/communication.md). Same results: every rank's slice of one sum that all ranks receive
    alike (a ring all-reduce hands each rank the same bits), and a broadcast copies bits.
    ``dim`` must be 0 (a flat bucket)."""

    def reduce_scatter(x: torch.Tensor, op: str, dim: int, group) -> torch.Tensor:
        shard = x.shape[0] // world_size
        return base.all_reduce(x, op, group).narrow(0, rank * shard, shard)

    def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
        parts = [base.broadcast(x if i == rank else torch.empty_like(x), i, group) for i in range(world_size)]
        return torch.cat([completed(p) for p in parts])

    def reduce_scatter_donated(x: torch.Tensor, op: str, dim: int, group) -> torch.Tensor:
        shard = x.shape[0] // world_size
        return all_reduce_in_place(x, op, group).narrow(0, rank * shard, shard)

    def all_gather_into(x: torch.Tensor, out: torch.Tensor, dim: int, group) -> torch.Tensor:
        # traced, as one op that mutates ``out`` (see ``_broadcast_shards_into_op``)
        (_broadcast_shards_into_op if compiling() else _broadcast_shards_into)(out, x, rank, world_size, group)
        return out

    return base._replace(reduce_scatter=reduce_scatter, all_gather=all_gather,
                         reduce_scatter_donated=reduce_scatter_donated, all_gather_into=all_gather_into)


def _broadcast_shards_into(out: torch.Tensor, x: torch.Tensor, rank: int, world_size: int, group: str) -> None:
    """The all-gather of the ``[S]`` shards ``x`` written into ``out`` (``[N*S]``): this rank's
    slice copied from ``x``, then every slice broadcast in place from its rank. No buffer but
    ``out`` and no copy but this rank's own slice."""
    shard = x.shape[0]
    slices = [out.narrow(0, i * shard, shard) for i in range(world_size)]
    slices[rank].copy_(x)
    for i, part in enumerate(slices):
        broadcast_in_place(part, i, group)


@torch.library.custom_op("fzero::broadcast_shards_into", mutates_args=("out",))
def _broadcast_shards_into_op(out: torch.Tensor, x: torch.Tensor, rank: int, world_size: int, group: str) -> None:
    """``_broadcast_shards_into`` as an op that ``torch.compile`` keeps whole. Written as
    functional collectives inside the graph, each shard arrived in a temporary (inductor does
    not reinplace a broadcast) and was copied into ``out``: a concatenation and a copy, three
    passes over the buffer; copied slice by slice, one loop over all of it that picked each
    element's slice (docs/communication.md has the profiles). Inductor calls the op on the
    graph input's own buffer."""
    _broadcast_shards_into(out, x, rank, world_size, group)


@_broadcast_shards_into_op.register_fake
def _(out, x, rank, world_size, group) -> None:
    return None


def for_backend(backend: str, rank: int, world_size: int) -> Collectives:
    """The table a ``Comm`` issues on a process group of ``backend``: ``over_all_reduce`` on
    gloo (CPU), ``FUNCTIONAL`` otherwise (NCCL's own reduce-scatter and all-gather are the
    fast ones)."""
    return over_all_reduce(rank, world_size) if backend == "gloo" and world_size > 1 else FUNCTIONAL


def completed(t: torch.Tensor) -> torch.Tensor:
    """``t``'s value: waited for if it is a collective's result still in flight, else ``t``."""
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


def sum_received(pieces: torch.Tensor, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[S]`` sum, in ``dtype``, of the ``world_size`` pieces an all-to-all delivered to this
    rank (``pieces``: ``[N*S]``, rank ``r``'s piece at ``r*S``), added in rank order: a
    reduce-scatter whose grads crossed the wire in their own dtype and are summed wider where
    they land (Megatron-LM's ``reduce_scatter_with_fp32_accumulation``). Each element is rounded
    once per addition, in ``dtype``: at 2 ranks bit for bit the FP32 reduce-scatter of an FP32
    copy (one addition, which commutes); beyond, in rank order instead of the ring's, and a
    16-bit ring reduce-scatter would round at each of its N-1 hops in 16 bits instead."""
    rows = pieces.view(world_size, -1)
    total = rows[0].to(dtype)
    for piece in rows[1:]:
        total = total + piece.to(dtype)
    return total
