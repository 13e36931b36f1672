"""What ``Engine.init`` builds and fixes: the state on this rank's shard, the binding to one
layout, and the settings every rank must share.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import optree
import torch

from .flat import Layout, leaf_paths
from .grads import GradPath
from .shard_view import ShardView

__all__ = ["ZeroState", "Binding", "fresh_state", "to_state_device", "config_table"]


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


def fresh_state(tx, context: ShardView, master: torch.Tensor) -> ZeroState:
    """The transform initialized on the FP32 ``master`` shard that ``context`` (the root
    ``ShardView`` of the rank's shard) describes: per-leaf settings (masks) refer to the params
    pytree and become bool shards like the master; a transform that groups leaves or needs them
    whole asks the context (``fzero.shard_view``)."""
    return ZeroState(master, tx.init(master, context=context))


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
