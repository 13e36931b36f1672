"""How the step's new params are gathered from every rank's cast shard (``StepPlan.gather``):
each way a small class with ``run(path, shard, params) -> new params``, ``params`` the door's form
(``fzero.params_form.ParamsForm``).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .arriving import arriving
from .cast import write_into
from .flat import leaf_views, unflatten
from .grads import GradPath
from .params_form import ParamsForm

__all__ = ["NoGather", "GatherInto", "GatherNew", "GatherLaunched"]


class NoGather(NamedTuple):
    """The update cast into the params' own buffer at world size 1: they are the new params."""

    def run(self, path: GradPath, shard: torch.Tensor, params: ParamsForm) -> Any:
        return params.given


class GatherInto(NamedTuple):
    """Donated, gathered into ``buffer``, the params' own flat buffer (no new buffer)."""

    buffer: torch.Tensor

    def run(self, path: GradPath, shard: torch.Tensor, params: ParamsForm) -> Any:
        path.comm.all_gather_into(self.buffer, shard.to(path.device, non_blocking=True), path.layout)
        return params.given


class GatherNew(NamedTuple):
    """Gathered into a new flat buffer, returned as the params came (flat, or a pytree of views
    of it); ``write``: then written into the given params."""

    write: bool

    def run(self, path: GradPath, shard: torch.Tensor, params: ParamsForm) -> Any:
        new_params = path.comm.all_gather(shard.to(path.device, non_blocking=True), path.layout)
        if params.flat_in:
            return write_into(params.given, new_params) if self.write else new_params
        if self.write:  # view by view into the door's leaves: no tree built, then walked again
            write_into(params.leaves, leaf_views(new_params, path.layout))
            return params.given
        return unflatten(new_params, path.layout, like=params.given)


class GatherLaunched(NamedTuple):
    """Left in flight (``zero1(overlap_gather=True)``, eager): issued bucket by bucket into
    ``buffer`` (the params' own flat buffer, donated) or a new one, and returned as the params
    came -- the flat buffer, or a pytree of its views -- as ``fzero.arriving.Arriving`` tensors,
    each waiting for its bucket at its first use."""

    buffer: torch.Tensor | None

    def run(self, path: GradPath, shard: torch.Tensor, params: ParamsForm) -> Any:
        layout = path.layout
        out = torch.empty(layout.padded_numel, dtype=shard.dtype, device=path.device) if self.buffer is None \
            else self.buffer
        in_flight = path.comm.start_all_gather_into(out, shard.to(path.device, non_blocking=True), layout)
        return arriving(out, in_flight, layout, flat=params.flat_in, like=params.given)
