"""``HybridComm``: a 2-D ``("replicate", "shard")`` device mesh, and the communicator of a mesh.

The state is sharded over the shard group and copied over the replicate group
(``zero1(mesh=...)``); ``comm_of_mesh`` picks ``Comm`` for a 1-D mesh and ``HybridComm`` for a
2-D one.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..layout import Layout
from . import arrival
from .collectives import Collectives, for_backend
from .group import Comm, group_named, name_of
from .teardown import shutdown_at_exit

__all__ = ["HybridComm", "comm_of_mesh"]


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
    mesh_ranks: tuple[int, ...] = ()  # the mesh's global ranks, replica-major: the same on every rank

    @property
    def data_parallel_name(self) -> str:
        """The mesh's ranks: no group's name is common to all of them (each shard group has its own)."""
        return "mesh-" + ",".join(map(str, self.mesh_ranks))

    @classmethod
    def of_mesh(cls, mesh, *, collectives: Collectives | None = None) -> "HybridComm":
        """The communicator of a 2-D ``("replicate", "shard")`` mesh, issuing ``collectives``
        (default: the table for the shard group's backend, as ``Comm.of``)."""
        shard, rep = mesh.get_group("shard"), mesh.get_group("replicate")
        shutdown_at_exit()
        rank, world_size = dist.get_rank(shard), dist.get_world_size(shard)
        collectives = collectives or for_backend(dist.get_backend(shard), rank, world_size)
        return cls(name_of(shard), rank, world_size, name_of(shard), name_of(rep), dist.get_rank(rep),
                   dist.get_world_size(rep), tuple(mesh.mesh.flatten().tolist()), collectives=collectives)

    def arrive(self, what: str, *, timeout: float) -> None:
        super().arrive(what, timeout=timeout)
        if self.replicas > 1:
            arrival.arrive(self.replicate, what, timeout=timeout)

    def check_unchanged(self) -> None:
        super().check_unchanged()
        try:
            now = dist.get_world_size(group_named(self.replicate))
        except (RuntimeError, ValueError, KeyError):
            now = 0
        if now != self.replicas:
            raise ValueError(f"replicate group has {now} ranks but the engine was initialized for {self.replicas}")

    def _sum_replicas(self, x: torch.Tensor, what) -> torch.Tensor:
        if self.replicas == 1:
            return x
        return self.issue(what, self.collectives.all_reduce, x, "sum", self.replicate)

    def reduce_scatter_bucket(self, x: torch.Tensor, i: int, layout: Layout, *, wait: bool = True,
                              donated: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Inside the shard group, then summed over the replicas; ``wait=False`` returns the
        shard group's part in flight and ``wait_reduced`` sums it over the replicas."""
        part = super().reduce_scatter_bucket(x, i, layout, wait=wait, donated=donated, dtype=dtype)
        return self._sum_replicas_of(part, i, layout) if wait else part

    def wait_reduced(self, x: torch.Tensor, i: int, layout: Layout, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._sum_replicas_of(super().wait_reduced(x, i, layout, dtype=dtype), i, layout)

    def _sum_replicas_of(self, part: torch.Tensor, i: int, layout: Layout) -> torch.Tensor:
        """Bucket ``i``'s reduced ``[S_b]`` part of the shard group, summed over the replicas."""
        return self._sum_replicas(part, lambda: f"all_reduce of grads over replicas (bucket {i} of {len(layout.buckets)})")

    def broadcast(self, x: torch.Tensor, what: str = "a tensor") -> torch.Tensor:
        """Rank 0 of the whole data-parallel world's ``x`` (replica 0, shard 0) on every rank:
        from shard 0 inside each shard group, then from replica 0 over the replicate group."""
        return self._from_first_replica(super().broadcast(x, what), what)

    def _from_first_replica(self, x: torch.Tensor, what: str) -> torch.Tensor:
        if self.replicas == 1:
            return x
        # src is the rank within the replicate group (a ProcessGroup's root rank)
        return self.issue(lambda: f"broadcast of {what} over replicas", self.collectives.broadcast, x, 0, self.replicate)

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, replica-major: ``[replica * S + shard]``."""
        inner = super().all_gather_object(obj)
        if self.replicas == 1:
            return inner
        out = [None] * self.replicas
        dist.all_gather_object(out, inner, group=group_named(self.replicate))
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
