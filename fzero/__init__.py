"""fzero: functional mixed-precision AdamW with ZeRO-1 optimizer-state sharding."""
from .engine import Accumulated, Engine, ZeroState, zero1
from .flat import Layout, flatten, make_layout, shard_of, tree_shard, unflatten
from .scaler import DynamicLossScale, LossScaleState, NoLossScale, StaticLossScale, scale_loss

__all__ = [
    "Accumulated",
    "DynamicLossScale",
    "Engine",
    "Layout",
    "LossScaleState",
    "NoLossScale",
    "StaticLossScale",
    "ZeroState",
    "flatten",
    "make_layout",
    "scale_loss",
    "shard_of",
    "tree_shard",
    "unflatten",
    "zero1",
]
