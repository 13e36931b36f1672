"""Optax-style gradient transformations on pytrees of tensors (no ranks, no process groups)."""
from .adam import ScaleByAdamState, adamw, scale_by_adam
from .base import (
    GradientTransformation,
    apply_updates,
    chain,
    get_hyperparams,
    identity,
    set_hyperparams,
)
from .scale import add_decayed_weights, scale_by_learning_rate

__all__ = [
    "GradientTransformation",
    "ScaleByAdamState",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "get_hyperparams",
    "identity",
    "scale_by_adam",
    "scale_by_learning_rate",
    "set_hyperparams",
]
