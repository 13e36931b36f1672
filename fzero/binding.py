"""What ``Engine.init`` builds and fixes: the state on this rank's shard, the binding to one
layout, and the settings every rank must share.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import optree
import torch

from fzero.transforms.tree import leaf_paths

from .cast import cast_params
from .comm import Comm, SimulatedComm, comm_of_mesh
from .flat import unflatten
from .grads import GradPath
from .layout import Layout
from .shard_view import ShardView

__all__ = ["ZeroState", "Binding", "communicator", "shapes_context", "first_rank_shard", "gathered", "fresh_state",
           "state_bytes", "to_state_device", "config_table"]


class ZeroState(NamedTuple):
    """``master``: ``[S]`` FP32 master weights of this rank's shard (as its storage keeps them:
    the int16 remainder with ``master="remainder"``, see ``fzero.storage``). ``tx_state``: the
    transform's state, built on that shard (e.g. Adam's ``count``, ``mu [S]``, ``nu [S]``)."""

    master: torch.Tensor
    tx_state: Any


@dataclasses.dataclass(frozen=True)
class Binding:
    """What ``init`` fixes: the gradient path (layout, communicator, device, dtypes), where the
    state lives, and the transform state's leaves ``(path, shape, dtype)`` and structure."""

    grads: GradPath
    state_device: torch.device
    tx_leaves: tuple
    tx_spec: optree.PyTreeSpec

    @classmethod
    def of(cls, grads: GradPath, state_device: torch.device, tx_state: Any) -> "Binding":
        paths, leaves, spec = leaf_paths(tx_state)
        return cls(grads, state_device, tuple((p, x.shape, x.dtype) for p, x in zip(paths, leaves)), spec)


def communicator(*, group, mesh, simulate) -> Comm | SimulatedComm:
    """The communicator of ``zero1(group=, mesh=, simulate=)``, at most one of them given
    (``fzero.options``); none: the default process group."""
    given = [name for name, v in (("group", group), ("mesh", mesh), ("simulate", simulate)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"zero1: give at most one of group=, mesh= and simulate= (got {' and '.join(given)})")
    if simulate is not None:
        return SimulatedComm(*simulate)
    if mesh is not None:
        return comm_of_mesh(mesh)
    return group if isinstance(group, (Comm, SimulatedComm)) else Comm.of(group)


def shapes_context(params: Any, layout: Layout, comm, device: torch.device) -> ShardView:
    """The root ``ShardView`` of this rank's shard of ``params`` laid out as ``layout``. The
    transform's init may look at the params' shapes (masks), not at their values: the context,
    which the engine keeps, holds no copy of them (each leaf is a 0-d zero expanded)."""
    zeros = optree.tree_map(lambda x: torch.zeros((), dtype=x.dtype, device=device).expand(x.shape), params)
    return ShardView.root(zeros, layout, comm, device)


def first_rank_shard(comm, values: Any, layout: Layout, what: str, param_dtype: torch.dtype,
                     state_device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's ``[S]`` FP32 shard of ``values`` (named ``what`` in errors) for this rank, where the
    state lives, and its cast to ``param_dtype`` (a new tensor), where the params live."""
    with torch.no_grad():
        shard = comm.first_rank_shard(values, layout, what=what)
        params_shard = cast_params(shard, param_dtype, copy=True)
    return to_state_device(shard, state_device), params_shard


def gathered(comm, params_shard: torch.Tensor, layout: Layout) -> Any:
    """Every rank's ``params_shard`` gathered into new params: a pytree of views of one buffer."""
    with torch.no_grad():
        return unflatten(comm.all_gather(params_shard, layout), layout)


def fresh_state(tx, context: ShardView, master: torch.Tensor) -> ZeroState:
    """The transform initialized on the FP32 ``master`` shard that ``context`` (the root
    ``ShardView`` of the rank's shard) describes: per-leaf settings (masks) refer to the params
    pytree and become bool shards like the master; a transform that groups leaves or needs them
    whole asks the context (``fzero.shard_view``)."""
    return ZeroState(master, tx.init(master, context=context))


def state_bytes(state: ZeroState) -> int:
    """Bytes of tensor storage ``state`` holds (master + transform)."""
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor))


def to_state_device(t: torch.Tensor, state_device: torch.device) -> torch.Tensor:
    """``t`` where the state lives: pinned host memory with ``offload``, which makes the per-step
    host<->device copies asynchronous DMA."""
    if state_device == t.device:
        return t
    return t.to(state_device).pin_memory() if torch.cuda.is_available() else t.to(state_device)


def config_table(settings: dict[str, str], layout: Layout, tx_state: Any) -> dict[str, str]:
    """The settings every rank must share besides the layout, as printable entries: the engine's
    ``settings`` (dtypes, loss scaling, stage, offload, master storage) and the transform's state
    (structure, each leaf's dtype, whether it is 1-D, and the value of each 0-d leaf: counts and
    hyperparameters; read once, at init)."""
    out = {**settings, "transform state": str(optree.tree_structure(tx_state))}
    for path, x in zip(*leaf_paths(tx_state)[:2]):
        if isinstance(x, torch.Tensor):
            # 1-D: [S], [S / block], or a group's compacted elements (transforms.partition), whose
            # length differs from rank to rank (and may equal S on one of them).
            what = repr(x.item()) if x.ndim == 0 else "1-D" if x.ndim == 1 else str(tuple(x.shape))
            out[f"transform leaf {path}"] = f"{what} {x.dtype}"
    return out
