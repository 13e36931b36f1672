"""``SimulatedComm``: any rank of any world size (or mesh) on one device, with no process group.

For memory accounting: the buffers have the true sizes, so one device measures what a rank of
a large world holds (``zero1(simulate=(rank, N))``).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..layout import Layout
from .communicator import Communicator

__all__ = ["SimulatedComm"]


@dataclasses.dataclass(frozen=True)
class SimulatedComm(Communicator):
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

    def reduce_scatter_bucket(self, x: torch.Tensor, i: int, layout: Layout, *, wait: bool = True,
                              donated: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
        b = layout.buckets[i]
        if dtype is None or dtype == x.dtype:
            return x[self.rank * b.shard : (self.rank + 1) * b.shard] * self.data_parallel
        # summed in a wider dtype as Comm does it (their memory): the all-to-all's [N*S_b]
        # receive buffer in x's dtype, then this rank's [S_b] sum in dtype
        received = x.clone()
        return received[self.rank * b.shard : (self.rank + 1) * b.shard].to(dtype) * self.data_parallel

    def all_gather_bucket(self, x: torch.Tensor, i: int, layout: Layout) -> torch.Tensor:
        return x.repeat(self.world_size)

    def all_gather_bucket_into(self, out: torch.Tensor, x: torch.Tensor, i: int, layout: Layout) -> torch.Tensor:
        return out.view(self.world_size, -1).copy_(x.expand(self.world_size, -1)).view(-1)

    def all_to_all(self, x: torch.Tensor, output_sizes: list[int], input_sizes: list[int]) -> torch.Tensor:
        # the true size; the values: this rank's pieces again, as if every rank held its tensors
        return x.repeat(-(-sum(output_sizes) // max(1, x.numel())))[: sum(output_sizes)] if x.numel() else x.new_zeros(sum(output_sizes))

    def all_reduce_sum(self, x: torch.Tensor, what: str = "the grad norm and found_inf") -> torch.Tensor:
        return x * self.world_size

    def broadcast(self, x: torch.Tensor, what: str = "a tensor") -> torch.Tensor:
        return x

    def all_gather_object(self, obj) -> list:
        return [obj] * self.world_size

    def time_buckets(self, layout, wire_dtype, reduce_dtype, gather_dtype, device) -> dict[str, list[float]]:
        return {"reduce_scatter_ms": [], "all_gather_ms": []}
