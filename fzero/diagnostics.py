"""Diagnostics for the rare event, off the hot path (they read tensor values: host syncs)."""
from __future__ import annotations

from typing import Any

import torch

from fzero.transforms.tree import leaf_paths

from .lineage import refuse_consumed

__all__ = ["nonfinite_leaves"]


def nonfinite_leaves(tree: Any) -> list[str]:
    """Paths of the leaves of ``tree`` holding an inf or NaN, e.g. ``["blocks/3/mlp/fc_w"]``.

    Call it when ``info["scale_stuck"]`` (or a run of ``found_inf``) says something is wrong,
    not every step: it syncs with the device once per leaf. A state that a donating step
    consumed raises (its memory holds that step's values)."""
    refuse_consumed(tree, "fzero.nonfinite_leaves")
    paths, leaves, _ = leaf_paths(tree)
    return [p for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor) and not bool(torch.isfinite(x).all())]
