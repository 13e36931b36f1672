"""Optax-style gradient transformations on pytrees of tensors (no ranks, no process groups).

Each transform is ``GradientTransformation(init, update)`` with ``init(params, *, context=None)``
and ``update(updates, state, params=None, **extra)``; they work on any pytree. A caller that
applies them to a flat shard of a pytree (fzero's engine: one rank's FP32 shard) passes
a ``ShardContext`` to ``init``, so that masks still refer to the pytree's leaves, and to every
``update`` of a transform that ``needs_context`` (``partition`` groups the shard's elements by
leaf, Muon has the caller make each matrix whole): see ``transforms.context``. ``scalar`` and ``hyperparam`` are the helpers for the 0-d
tensors of states and steps (see ``transforms.scalars``). ``transforms.quantize`` is the 8-bit
block-wise storage of ``adamw(mu_dtype=torch.int8, nu_dtype=torch.int8)``'s moments.
``partition`` gives each group of leaves its own transform (``muon`` for hidden matrices, say).
"""

if __name__ != "fzero.transforms":  # the folder imported by its own name, from a checkout on sys.path
    from fzero.transforms._alias import one_module

    one_module(__name__, "fzero.transforms")  # the import then returns fzero.transforms itself

from .adafactor import AdafactorState, adafactor
from .adam import ScaleByAdamState, adamw, scale_by_adam
from .ademamix import ScaleByAdemamixState, ademamix, scale_by_ademamix
from .protocol import GradientTransformation, apply_updates, identity
from .combine import MaskedState, chain, masked
from .context import ShardContext, Split, resolve_per_leaf
from .fused import FusedStep
from .hyperparams import get_hyperparams, iter_hyperparams, set_hyperparams
from .lamb import lamb, scale_by_trust_ratio
from .lion import ScaleByLionState, lion, scale_by_lion
from .clip import clip_by_global_norm, global_norm
from .muon import ScaleByMuonState, muon, newton_schulz, scale_by_muon
from .partition import PartitionState, partition
from .scalars import host_value, hyperparam, scalar, with_host_value
from .schedule_free import ScheduleFreeState, schedule_free_adamw, schedule_free_eval_params
from .scale import add_decayed_weights, scale_by_learning_rate
from .schedules import constant, cosine_decay, linear, linear_warmup, warmup_cosine_decay
from .sgd import sgd, trace

__all__ = [
    "AdafactorState",
    "FusedStep",
    "GradientTransformation",
    "MaskedState",
    "PartitionState",
    "ScaleByAdamState",
    "ScaleByAdemamixState",
    "ScaleByLionState",
    "ScaleByMuonState",
    "ScheduleFreeState",
    "ShardContext",
    "Split",
    "adafactor",
    "adamw",
    "ademamix",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cosine_decay",
    "get_hyperparams",
    "iter_hyperparams",
    "global_norm",
    "hyperparam",
    "identity",
    "linear",
    "lamb",
    "linear_warmup",
    "lion",
    "masked",
    "muon",
    "newton_schulz",
    "partition",
    "resolve_per_leaf",
    "scalar",
    "host_value",
    "with_host_value",
    "scale_by_adam",
    "scale_by_ademamix",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_muon",
    "scale_by_trust_ratio",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "set_hyperparams",
    "sgd",
    "trace",
    "warmup_cosine_decay",
]
