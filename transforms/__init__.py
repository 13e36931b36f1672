"""Optax-style gradient transformations on pytrees of tensors (no ranks, no process groups).

Each transform is ``GradientTransformation(init, update)``; fzero's engine applies them to one
rank's flat FP32 shard, and they work on any pytree as well.
"""
from .adam import ScaleByAdamState, adamw, scale_by_adam
from .base import (
    GradientTransformation,
    MaskedState,
    apply_updates,
    chain,
    get_hyperparams,
    iter_hyperparams,
    identity,
    masked,
    set_hyperparams,
)
from .clip import clip_by_global_norm, global_norm
from .scale import add_decayed_weights, scale_by_learning_rate
from .schedules import constant, cosine_decay, linear, linear_warmup, warmup_cosine_decay
from .sgd import sgd, trace

__all__ = [
    "GradientTransformation",
    "MaskedState",
    "ScaleByAdamState",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cosine_decay",
    "get_hyperparams",
    "iter_hyperparams",
    "global_norm",
    "identity",
    "linear",
    "linear_warmup",
    "masked",
    "scale_by_adam",
    "scale_by_learning_rate",
    "set_hyperparams",
    "sgd",
    "trace",
    "warmup_cosine_decay",
]
