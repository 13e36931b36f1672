"""Input validation: clear errors that name the offending leaf (off the numeric path).

Everything here reads only static facts (structure, shapes, dtypes, devices), never tensor
values, so it costs no host sync and traces to nothing under ``torch.compile``.
"""
from __future__ import annotations

from typing import Any

import optree
import torch

from .flat import Layout, leaf_paths

def _compiling() -> bool:
    return torch.compiler.is_compiling()


__all__ = ["PARAM_DTYPES", "check_param_dtype", "check_params", "check_like_layout", "check_flat"]

PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_param_dtype(dtype) -> torch.dtype:
    if dtype not in PARAM_DTYPES:
        raise TypeError(f"param_dtype must be one of torch.float16, torch.bfloat16, torch.float32; got {dtype!r}")
    return dtype


def check_params(params: Any) -> None:
    """``params`` for ``engine.init``: a non-empty pytree of floating tensors on one device."""
    paths, leaves, _ = leaf_paths(params)
    if not leaves:
        raise ValueError("params has no tensor leaves")
    device = None
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"params leaf {path!r} is a {type(leaf).__name__}, not a torch.Tensor")
        if not leaf.is_floating_point():
            raise TypeError(f"params leaf {path!r} has dtype {leaf.dtype}; parameters must be floating point")
        device = device or leaf.device
        if leaf.device != device:
            raise ValueError(f"params leaf {path!r} is on {leaf.device}, other leaves on {device}")


def _first_structure_difference(tree: Any, layout: Layout) -> str:
    paths, _, _ = leaf_paths(tree)
    for i, (want, got) in enumerate(zip(layout.paths, paths)):
        if want != got:
            return f"leaf {i} is {got!r}, expected {want!r}"
    if len(paths) != len(layout.paths):
        return f"{len(paths)} leaves, expected {len(layout.paths)}"
    return "the container types differ"


def check_like_layout(
    tree: Any, layout: Layout, *, what: str, device: torch.device, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Check ``tree`` has the layout's structure and shapes, floating leaves of ``dtype`` (if
    given) on ``device``, none requiring grad; return its leaves. ``what`` names the argument
    in errors ("grads", "params"). Non-contiguous leaves are fine: every leaf is copied."""
    leaves = optree.tree_leaves(tree)
    # Dynamo cannot trace a PyTreeSpec comparison; a compiled step still checks the leaf count
    # and every shape below, and guards on the structure it was traced with.
    if len(leaves) != len(layout.paths) or (not _compiling() and optree.tree_structure(tree) != layout.treespec):
        raise ValueError(f"{what} structure differs from params: {_first_structure_difference(tree, layout)}")
    for path, shape, leaf in zip(layout.paths, layout.shapes, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{what} leaf {path!r} is a {type(leaf).__name__}, not a torch.Tensor")
        if leaf.shape != shape:
            raise ValueError(f"{what} leaf {path!r} has shape {tuple(leaf.shape)}, expected {tuple(shape)}")
        if not leaf.is_floating_point():
            raise TypeError(f"{what} leaf {path!r} has dtype {leaf.dtype}, expected a floating dtype")
        if dtype is not None and leaf.dtype != dtype:
            raise TypeError(f"{what} leaf {path!r} has dtype {leaf.dtype}, expected {dtype} (the engine's param_dtype)")
        if leaf.device != device:
            raise ValueError(f"{what} leaf {path!r} is on {leaf.device}, the params are on {device}")
        if leaf.requires_grad:
            raise ValueError(
                f"{what} leaf {path!r} requires grad; pass plain tensors (torch.func.grad returns them; "
                "for autograd results use .detach())"
            )
    return leaves


def check_flat(flat: torch.Tensor, layout: Layout, *, what: str, device: torch.device, dtype: torch.dtype) -> None:
    """A flat ``[N*S]`` params or grads buffer: ``dtype`` on ``device``, not requiring grad."""
    if flat.dtype != dtype:
        raise TypeError(f"flat {what} have dtype {flat.dtype}, expected {dtype} (the engine's param_dtype)")
    if flat.device != device:
        raise ValueError(f"flat {what} are on {flat.device}, the params are on {device}")
    if flat.requires_grad:
        raise ValueError(f"flat {what} require grad; pass plain tensors (torch.func.grad returns them)")
