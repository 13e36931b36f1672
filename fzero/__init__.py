"""fzero: functional mixed-precision AdamW with ZeRO-1 optimizer-state sharding."""
from . import checkpoint, module
from .comm import CollectiveError, shutdown
from .diagnostics import nonfinite_leaves
from .engine import Accumulated, Engine, ZeroState
from .flat import Layout, flatten, make_layout, shard_of, tree_shard, unflatten
from .options import zero1
from .scaler import DynamicLossScale, LossScaleState, NoLossScale, StaticLossScale, scale_loss

__all__ = [
    "Accumulated",
    "CollectiveError",
    "DynamicLossScale",
    "Engine",
    "Layout",
    "checkpoint",
    "LossScaleState",
    "NoLossScale",
    "StaticLossScale",
    "ZeroState",
    "flatten",
    "make_layout",
    "module",
    "nonfinite_leaves",
    "scale_loss",
    "shard_of",
    "shutdown",
    "tree_shard",
    "unflatten",
    "zero1",
]
