"""The stages of ``Engine.step``, each a function of the step's inputs and its ``StepPlan``
(``fzero.plan``): reduce -> norm and overflow -> update -> gather (the loss scale then updates
itself, see ``fzero.scaler``). The stages read the plan and ask nothing again.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .grad_forms import Reduced
from .grads import GradPath
from .plan import StepPlan
from .update import ShardGrads

__all__ = ["Checked", "reduce", "norm_and_overflow", "update", "gather"]


def reduce(path: GradPath, grads: Any, plan: StepPlan) -> Reduced:
    """This rank's ``[S]`` shard of the grads over ranks; ``shard * factor`` is their mean (the
    user's grads take one of two forms at the door, see ``fzero.grads``). With
    ``plan.segments``, the shard is read as ``Segments``: at world size 1 the grad leaves."""
    return path.reduce(path.to_form(grads, segments=plan.segments, donated=plan.donate))


class Checked(NamedTuple):
    """The step's grads and what the one small all-reduce found: ``found_inf`` (0-d bool, the
    same on every rank), ``norm`` (0-d float64 global norm of the mean unscaled grads, NaN on
    any overflow), ``skip`` (0-d bool: an overflow, or a non-finite value in ``rates``) and
    ``rates``, the transform's values at this step that are not stored (a schedule's lr)."""

    grads: ShardGrads
    found_inf: torch.Tensor
    norm: torch.Tensor
    skip: torch.Tensor
    rates: dict


def norm_and_overflow(path: GradPath, reduced: Reduced, scale: torch.Tensor, tx, tx_state: Any,
                      plan: StepPlan) -> Checked:
    """One small all-reduce: the global sum of squares of the mean unscaled grads, which are
    shard / grad_scale, summed from the shard as it came, scaled (in FP32 for FP16 grads: it
    cannot overflow, see ``fzero.norm.sum_of_squares``), with the plan's ``norm``. Any inf/NaN on
    any rank makes it non-finite, so it doubles as the cross-rank found_inf agreement. Padding is
    zero."""
    grads = ShardGrads.of(reduced, scale)
    sumsq = plan.norm(grads.segments(), bounded=path.param_dtype == torch.float16)
    sumsq = sumsq / grads.grad_scale.double().square()
    sumsq = path.comm.all_reduce_sum(sumsq)
    found_inf = ~torch.isfinite(sumsq)
    # One NaN for every overflow: a NaN's sign and payload come from whichever operand the
    # kernels met first, which changes with the fusion of the compiled graph around it.
    norm = torch.where(torch.isnan(sumsq), torch.nan, torch.sqrt(sumsq))
    # The same on every rank; a non-finite one skips the update like an overflow (the loss
    # scale stays).
    rates = tx.hyperparams(tx_state) if tx.hyperparams else {}
    skip = found_inf
    for v in rates.values():
        skip = skip | ~torch.isfinite(v)
    return Checked(grads, found_inf, norm, skip, rates)


def update(tx, checked: Checked, master: torch.Tensor, tx_state: Any, plan: StepPlan):
    """Transform, skip if not finite, cast: ``(master, tx_state, params shard)`` on the FP32
    shard where the state lives (the host with offload: a blocking copy of the grads there),
    with the plan's variant (``plan.update.run``), which casts where ``plan.cast`` says."""
    skip, norm = checked.skip.to(plan.state_device), checked.norm.to(plan.state_device)
    return plan.update.run(tx, checked.grads, master, tx_state, skip, norm)


def gather(path: GradPath, shard: torch.Tensor, plan: StepPlan) -> Any:
    """Everyone's cast shard gathered into the new params, as the params came (flat or a
    pytree: ``plan.params``, the door's form), the way ``plan.gather`` says (``fzero.gather``)."""
    return plan.gather.run(path, shard, plan.params)
