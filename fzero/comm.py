"""Every cross-rank point of fzero, in one file.

The collectives are torch's *functional* collectives (``torch.distributed._functional_collectives``):
they return new tensors instead of mutating, so the step stays pure and ``torch.compile``
traces them into the graph (``fullgraph=True``). In eager mode their results are waited on
here, before they leave this module. Each collective is one call per bucket, never per leaf.

Three communicators with one interface: ``Comm``, the static view of a process group that
the step needs (``None`` group, or a world of one, means one process: no collective is ever
called); ``HybridComm``, a 2-D ``("replicate", "shard")`` device mesh (state sharded over the
shard group, copied over the replicate group: ``zero1(mesh=...)``); and ``SimulatedComm``, any
rank of any world size (or mesh) on one device with no process group (for memory accounting).
The engine takes any of them (``zero1(group=...)``), and so can a test's recording subclass.
``rank`` and ``world_size`` are always the shard group's: what the layout is built for. The
averaging lives here too: ``reduce_scatter_mean`` and ``start_mean`` hide FSDP's pre/post split
of the 1/N behind ``mean_factor``.

**Holding no process group.** ``Comm`` keeps the group's *name*, never the ``ProcessGroup``
object: the functional collectives take the name, and the few object-based calls (barrier,
``all_gather_object``) resolve it when they run. A reference held past
``destroy_process_group()`` keeps the backend alive, and with it gloo's worker and socket
threads, into interpreter shutdown, where a rank then intermittently aborted with
``terminate called without an active exception``. For the same reason this module imports
``torch._dynamo`` at once: its first import (which the first functional collective would
otherwise trigger) takes references to every process group that exists at that moment.
``shutdown()`` (also run at interpreter exit, see there) then frees the backend while the
interpreter is still alive.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import sys
import time
import warnings
import weakref
from typing import ClassVar

import torch
import torch.distributed as dist

# Imported after init_process_group, the import of torch._dynamo below takes references to the
# groups that exist (see above): shutdown's warning then names the import order as the cause.
_IMPORTED_AFTER_GROUP = "torch._dynamo" not in sys.modules and dist.is_available() and dist.is_initialized()
import torch._dynamo  # noqa: E402,F401 -- before any process group exists: see the module docstring
import torch.distributed._functional_collectives as funcol

from . import arrival
from .flat import Layout, concat

__all__ = ["Comm", "HybridComm", "SimulatedComm", "CollectiveError", "resolve_group", "comm_of_mesh", "shutdown",
           "predivide_factor"]

# torch >= 2.5 renamed the single-tensor collectives; same signature and semantics.
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_all_reduce = funcol.all_reduce
_broadcast = funcol.broadcast


def _wait(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


class CollectiveError(RuntimeError):
    """A collective failed (a peer died, timed out, or disagreed); names the collective and rank."""


def resolve_group(group):
    """``group`` as given, or WORLD when ``None`` and torch.distributed is initialized, else ``None``."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def _group_name(group) -> str | None:
    return None if group is None else group.group_name


def _resolve_name(name: str):
    return dist.distributed_c10d._resolve_process_group(name)


class _Collectives:
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

    def wait_reduced(self, x: torch.Tensor, i: int, layout: Layout) -> torch.Tensor:
        """Finish bucket ``i``'s reduce started with ``start_mean(..., wait=False)``."""
        return self.wait(x, f"reduce_scatter of grads (bucket {i} of {len(layout.buckets)})")

    def replicate_shard(self, shard: torch.Tensor) -> torch.Tensor:
        """The first replica's ``shard`` (hybrid: a broadcast over the replicate group), so that
        every copy of the state starts equal. Identity without replicas."""
        return shard

    def start_mean(self, x: torch.Tensor, i: int, layout: Layout, *, wait: bool = True) -> torch.Tensor:
        """Bucket ``i``'s ``[N*S_b]`` grads (a buffer the caller gives up: pre-divided in place)
        -> this rank's ``[S_b]`` partial mean; scale by ``mean_factor(x.dtype)`` to finish it.
        ``wait=False``: returns while the collective is in flight (see ``wait``)."""
        pre = self._pre(x.dtype)
        return self.reduce_scatter_bucket(x if pre == 1.0 else x.div_(pre), i, layout, wait=wait)

    def reduce_scatter_mean(self, buckets: list[torch.Tensor], layout: Layout) -> tuple[torch.Tensor, float]:
        """Per-bucket ``[N*S_b]`` grads of this rank (not modified) -> ``(partial, factor)``:
        ``partial * factor`` is this rank's ``[S]`` shard of their mean over ranks. The factor is
        left to the caller so that it joins the step's one FP32 multiply (unscale, micro-batches).

        Summing N scaled FP16 grads can overflow by itself: an FP32 sum cannot; a sum in FP16/BF16
        divides its inputs by ``pre`` ~ sqrt(N) first (``predivide_factor``)."""
        pre = self._pre(buckets[0].dtype)
        parts = [self.reduce_scatter_bucket(x if pre == 1.0 else x / pre, i, layout) for i, x in enumerate(buckets)]
        return concat(parts), self.mean_factor(buckets[0].dtype)

    def all_gather(self, shard: torch.Tensor, layout: Layout) -> torch.Tensor:
        """This rank's ``[S]`` shard -> the ``[padded_numel]`` buffer of every rank's shard."""
        if self.world_size == 1:
            return shard
        parts, pos = [], 0
        for i, b in enumerate(layout.buckets):
            parts.append(self.all_gather_bucket(shard[pos : pos + b.shard], i, layout))
            pos += b.shard
        return concat(parts)

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
                diffs.append(f"{key} is " + " but ".join(f"{v} on {arrival.ranks_text(r)}" for v, r in ranks_of.items()))
        more = f"; and {len(diffs) - 4} more" if len(diffs) > 4 else ""
        raise ValueError(f"{what} differs across ranks: " + "; ".join(diffs[:4]) + more)


@dataclasses.dataclass(frozen=True)
class Comm(_Collectives):
    """A process group (or none), by name, with the rank and size read once at engine init.

    ``requested`` is the name of the group the user gave (``None`` means "WORLD if
    initialized"), kept to notice a world that changed since init."""

    group: str | None  # the process group's name (see the module docstring)
    rank: int
    world_size: int
    requested: str | None = None

    @classmethod
    def of(cls, requested) -> "Comm":
        """The communicator of ``requested`` (a ProcessGroup; ``None``: WORLD if initialized,
        else one process)."""
        group = resolve_group(requested)
        if group is None:
            return cls(None, 0, 1, None)
        _shutdown_at_exit()
        return cls(_group_name(group), dist.get_rank(group), dist.get_world_size(group), _group_name(requested))

    def process_group(self):
        """The ``ProcessGroup`` object, resolved now (off the hot path: barriers, objects)."""
        return _resolve_name(self.group)

    def arrive(self, what: str, *, timeout: float) -> None:
        """Every rank reaches the collective call ``what`` within ``timeout`` seconds, or every
        waiting rank raises naming the missing ones (``fzero.arrival``). Off the hot path."""
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
                now = dist.get_world_size(_resolve_name(self.requested))
            except (RuntimeError, ValueError, KeyError):
                now = 0
        if now != self.world_size:
            raise ValueError(
                f"process group has {now} ranks but the engine was initialized for {self.world_size}; "
                "re-run engine.init (or load a checkpoint) at the new world size"
            )

    def _call(self, what, fn, *args, wait: bool = True) -> torch.Tensor:
        """Run one functional collective and (unless ``wait=False``) wait for it; in eager mode
        a failure (e.g. a dead peer: gloo/NCCL raise after the process group's timeout at the
        latest) is re-raised naming the collective and this rank. ``what()`` names the
        collective; it is only called eager (traced, the layout's ints may be symbolic)."""
        if torch.compiler.is_compiling():
            return _wait(fn(*args))
        what = what()
        try:
            out = fn(*args)
        except RuntimeError as e:
            raise CollectiveError(f"fzero: {what} failed on rank {self.rank} of {self.world_size}: {e}") from e
        return self.wait(out, what) if wait else out

    def wait(self, x: torch.Tensor, what: str = "collective") -> torch.Tensor:
        """Wait for a collective started with ``wait=False``; errors name ``what`` and this rank."""
        try:
            return _wait(x)
        except RuntimeError as e:
            raise CollectiveError(f"fzero: {what} failed on rank {self.rank} of {self.world_size}: {e}") from e

    def reduce_scatter_bucket(self, x: torch.Tensor, i: int, layout: Layout, *, wait: bool = True) -> torch.Tensor:
        """Bucket ``i``'s ``[N*S_b]`` buffer -> this rank's ``[S_b]`` slice of its sum over ranks.

        ``wait=False`` returns while the collective is in flight (an ``AsyncCollectiveTensor``
        that waits when first used, or explicitly via ``wait``): how backward overlaps it."""
        if self.world_size == 1:
            return x
        what = lambda: f"reduce_scatter of grads (bucket {i} of {len(layout.buckets)}, {x.numel()} elements)"
        return self._call(what, _reduce_scatter, x, "sum", 0, self.group, wait=wait)

    def all_gather_bucket(self, x: torch.Tensor, i: int, layout: Layout) -> torch.Tensor:
        """This rank's ``[S_b]`` slice of bucket ``i`` -> the bucket's ``[N*S_b]`` buffer."""
        if self.world_size == 1:
            return x
        b = layout.buckets[i]
        what = lambda: f"all_gather of params (bucket {i} of {len(layout.buckets)}, {b.shard} elements per rank)"
        return self._call(what, _all_gather, x, 0, self.group)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks of a small tensor."""
        if self.world_size == 1:
            return x
        return self._call(lambda: "all_reduce of the grad norm and found_inf", _all_reduce, x, "sum", self.group)

    def all_gather_object(self, obj) -> list:
        """Off the hot path only (init, errors): pickles ``obj`` to every rank."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.process_group())
        return out

    def time_buckets(self, layout: Layout, reduce_dtype: torch.dtype, gather_dtype: torch.dtype,
                     device: torch.device) -> dict[str, list[float]]:
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
        for i, b in enumerate(layout.buckets):
            x = torch.zeros(self.world_size * b.shard, dtype=reduce_dtype, device=device)
            rs.append(timed(lambda: self.reduce_scatter_bucket(x, i, layout)))
            y = torch.zeros(b.shard, dtype=gather_dtype, device=device)
            ag.append(timed(lambda: self.all_gather_bucket(y, i, layout)))
        t = torch.tensor([rs, ag], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
        return {"reduce_scatter_ms": t[0].tolist(), "all_gather_ms": t[1].tolist()}


@dataclasses.dataclass(frozen=True)
class HybridComm(Comm):
    """Hybrid sharding on a 2-D ``DeviceMesh`` named ``("replicate", "shard")``: the state is
    sharded over the ``shard`` group (``rank``/``world_size`` are that group's, so the layout is
    for S ranks) and held whole by each of the R replicas in the ``replicate`` group.

    Per bucket the grads are reduce-scattered inside the shard group, then the ``[S_b]`` result
    is summed over the replicate group (one all-reduce of 1/S of the grads), and the new params
    are all-gathered inside the shard group. After that all-reduce every replica holds the same
    reduced shard bit for bit, so the norm's all-reduce over the shard group is already the
    global one, and an inf/NaN on any rank has reached every rank's sum: one agreement for all.
    Object gathers (init checks, checkpoints) go over both groups and list ranks replica-major
    (the mesh's order)."""

    replicate: str | None = None  # the replicate group's name
    replica: int = 0  # this rank's index in it
    replicas: int = 1  # its size

    @classmethod
    def of_mesh(cls, mesh) -> "HybridComm":
        shard, rep = mesh.get_group("shard"), mesh.get_group("replicate")
        _shutdown_at_exit()
        return cls(_group_name(shard), dist.get_rank(shard), dist.get_world_size(shard), _group_name(shard),
                   _group_name(rep), dist.get_rank(rep), dist.get_world_size(rep))

    def arrive(self, what: str, *, timeout: float) -> None:
        super().arrive(what, timeout=timeout)
        if self.replicas > 1:
            arrival.arrive(self.replicate, what, timeout=timeout)

    def check_unchanged(self) -> None:
        super().check_unchanged()
        try:
            now = dist.get_world_size(_resolve_name(self.replicate))
        except (RuntimeError, ValueError, KeyError):
            now = 0
        if now != self.replicas:
            raise ValueError(f"replicate group has {now} ranks but the engine was initialized for {self.replicas}")

    def _sum_replicas(self, x: torch.Tensor, what) -> torch.Tensor:
        if self.replicas == 1:
            return x
        return self._call(what, _all_reduce, x, "sum", self.replicate)

    def reduce_scatter_bucket(self, x: torch.Tensor, i: int, layout: Layout, *, wait: bool = True) -> torch.Tensor:
        """Inside the shard group, then summed over the replicas; ``wait=False`` returns the
        shard group's part in flight and ``wait_reduced`` sums it over the replicas."""
        part = super().reduce_scatter_bucket(x, i, layout, wait=wait)
        return self._sum_replicas_of(part, i, layout) if wait else part

    def wait_reduced(self, x: torch.Tensor, i: int, layout: Layout) -> torch.Tensor:
        return self._sum_replicas_of(super().wait_reduced(x, i, layout), i, layout)

    def _sum_replicas_of(self, part: torch.Tensor, i: int, layout: Layout) -> torch.Tensor:
        """Bucket ``i``'s reduced ``[S_b]`` part of the shard group, summed over the replicas."""
        return self._sum_replicas(part, lambda: f"all_reduce of grads over replicas (bucket {i} of {len(layout.buckets)})")

    def replicate_shard(self, shard: torch.Tensor) -> torch.Tensor:
        if self.replicas == 1:
            return shard
        # src is the rank within the replicate group (a ProcessGroup's root rank)
        return self._call(lambda: "broadcast of the initial shard over replicas", _broadcast, shard, 0, self.replicate)

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, replica-major: ``[replica * S + shard]``."""
        inner = super().all_gather_object(obj)
        if self.replicas == 1:
            return inner
        out = [None] * self.replicas
        dist.all_gather_object(out, inner, group=_resolve_name(self.replicate))
        return [x for group in out for x in group]


def comm_of_mesh(mesh) -> Comm:
    """The communicator of a ``DeviceMesh``: 1-D, its group's ``Comm``; 2-D, named
    ``("replicate", "shard")``, a ``HybridComm``."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        return Comm.of(mesh.get_group())
    if mesh.ndim != 2 or names != ("replicate", "shard"):
        raise ValueError(f"mesh must be 1-D, or 2-D with mesh_dim_names ('replicate', 'shard'); got {mesh.ndim}-D "
                         f"with names {names or None} (init_device_mesh(device_type, (R, S), "
                         "mesh_dim_names=('replicate', 'shard')))")
    return HybridComm.of_mesh(mesh)


@dataclasses.dataclass(frozen=True)
class SimulatedComm(_Collectives):
    """Rank ``rank`` of ``world_size`` ranks that all hold identical tensors, with no process
    group: sums are ``world_size * x``, gathers repeat this rank's shard. The buffers have the
    true sizes, so one device measures any rank of any world size (``zero1(group=
    SimulatedComm(0, 64))``, or its shorthand ``zero1(simulate=(0, 64))``). ``replicas=R``
    simulates a hybrid mesh of R replicas x ``world_size`` shards (``simulate=(0, 8, 8)``: an
    8x8 mesh): the grads are then summed over all R x world_size ranks."""

    rank: int
    world_size: int
    replicas: int = 1
    simulated: ClassVar[bool] = True

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world_size})")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")

    def check_unchanged(self) -> None:
        """A simulated world never changes."""

    def arrive(self, what: str, *, timeout: float) -> None:
        """Every simulated rank is here."""

    def wait(self, x: torch.Tensor, what: str = "collective") -> torch.Tensor:
        return x

    def reduce_scatter_bucket(self, x: torch.Tensor, i: int, layout: Layout, *, wait: bool = True) -> torch.Tensor:
        b = layout.buckets[i]
        return x[self.rank * b.shard : (self.rank + 1) * b.shard] * self.data_parallel

    def all_gather_bucket(self, x: torch.Tensor, i: int, layout: Layout) -> torch.Tensor:
        return x.repeat(self.world_size)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.world_size

    def all_gather_object(self, obj) -> list:
        return [obj] * self.world_size

    def time_buckets(self, layout, reduce_dtype, gather_dtype, device) -> dict[str, list[float]]:
        return {"reduce_scatter_ms": [], "all_gather_ms": []}


_exit_hook_registered = False


def _shutdown_at_exit() -> None:
    """Run ``shutdown(barrier=False)`` at interpreter exit (once per process): a script that
    ends without ``destroy_process_group`` still frees the backend before finalization."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(shutdown, barrier=False, at_exit=True)


def shutdown(*, barrier: bool = True, at_exit: bool = False, timeout: float = 60.0) -> None:
    """End this process's use of torch.distributed: wait for every rank (``barrier``, at most
    ``timeout`` seconds for the last one to arrive, see ``fzero.arrival``), then
    ``destroy_process_group()`` and check that the backend is really gone.

    Called while an exception propagates (``try: main() finally: fzero.shutdown()``), it waits
    for nobody and destroys nothing: it tells the ranks waiting in an fzero call that this rank
    failed (they raise at once, naming its error) and returns, so the exception is shown and the
    process exits, which ends its peers' collectives too (a collective of this rank may still be
    in flight: destroying the group would wait for it).

    Call it on every rank at the end of a torchrun script (it is a no-op when no process
    group is initialized). Destroying the group joins the backend's threads (gloo's workers
    and socket loop) while the interpreter is still alive; a backend that outlives it runs
    those threads through interpreter shutdown, where a rank could abort with ``terminate
    called without an active exception``. The barrier keeps a rank from tearing its
    connections down while a peer still uses them. fzero registers ``shutdown(barrier=False)``
    to run at interpreter exit, so a script that ends without it is safe as well -- unless it
    still holds a ``ProcessGroup`` object of its own then, which keeps the backend alive: a
    ``RuntimeWarning`` says so. The exit hook does nothing after an uncaught exception (a
    collective may still be in flight; destroying the group would wait for it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if at_exit and (getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)) is not None:
        return  # an uncaught exception ends the script: a collective may still be in flight, don't wait on it
    failing = sys.exc_info()[1]
    if failing is not None and not at_exit:
        arrival.report_failure(failing)
        return
    group = dist.group.WORLD
    if barrier:
        if dist.get_world_size() > 1:
            arrival.arrive(group.group_name, "fzero.shutdown", timeout=timeout)
        dist.barrier()
    alive = weakref.ref(group)
    del group
    arrival.reset()
    dist.destroy_process_group()
    if alive() is not None:
        cause = ("fzero was imported after init_process_group, and its import of torch._dynamo took references to "
                 "the process groups alive then: import fzero before init_process_group" if _IMPORTED_AFTER_GROUP else
                 "drop your references to ProcessGroup objects before exit")
        warnings.warn(
            "fzero.shutdown: the default process group is still referenced after destroy_process_group(), "
            f"so its backend threads outlive it; {cause}",
            RuntimeWarning,
            stacklevel=3 if at_exit else 2,
        )


def predivide_factor(world_size: int) -> float:
    """FSDP's split of the 1/N average for low-precision sums: inputs are divided by ``f``
    (about sqrt(N), a power of two) before the reduction and the result by ``N/f`` after, so
    neither the sum of N scaled grads overflows nor the pre-divided inputs underflow."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)
