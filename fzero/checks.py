"""Input validation: clear errors that name the offending leaf (off the numeric path).

Everything here reads only static facts (structure, shapes, dtypes, devices), never tensor
values, so it costs no host sync and traces to nothing under ``torch.compile``.
"""
from __future__ import annotations

from typing import Any

import optree
import torch

from fzero.transforms.tree import leaf_paths

from .flat import tree_leaves
from .layout import Layout
from .memory import shared_memory
from .scaler import DynamicLossScale, LossScaleState, StaticLossScale
from .tracing import compiling

__all__ = [
    "PARAM_DTYPES",
    "check_param_dtype",
    "check_options",
    "check_params",
    "check_like_layout",
    "check_flat",
    "check_state",
    "first_difference",
]

PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_param_dtype(dtype) -> torch.dtype:
    if dtype not in PARAM_DTYPES:
        raise TypeError(f"param_dtype must be one of torch.float16, torch.bfloat16, torch.float32; got {dtype!r}")
    return dtype


def check_options(loss_scale, *, param_dtype, reduce_dtype, wire_dtype, stage, offload, bucket_bytes,
                  chunk_numel, call_timeout, overlap_gather) -> None:
    """The options of ``fzero.zero1`` besides the param dtype; errors name the option."""
    if not isinstance(loss_scale, (DynamicLossScale, StaticLossScale)):
        raise TypeError(f"loss_scale must be DynamicLossScale, StaticLossScale or None, got {loss_scale!r}")
    if reduce_dtype not in (torch.float32, param_dtype):
        raise TypeError(f"reduce_dtype must be torch.float32 or the param_dtype {param_dtype}, got {reduce_dtype}")
    if wire_dtype not in (None, param_dtype, reduce_dtype):
        raise TypeError(f"wire_dtype must be None, the param_dtype {param_dtype} or the reduce_dtype {reduce_dtype}, "
                        f"got {wire_dtype}")
    if not isinstance(overlap_gather, bool):
        raise TypeError(f"overlap_gather must be True or False, got {overlap_gather!r}")
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage}")
    if offload not in (None, "cpu"):
        raise ValueError(f"offload must be None or 'cpu', got {offload!r}")
    for name, value in (("bucket_bytes", bucket_bytes), ("chunk_numel", chunk_numel)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive or None, got {value}")
    if not (isinstance(call_timeout, (int, float)) and not isinstance(call_timeout, bool) and call_timeout > 0):
        raise ValueError(f"call_timeout must be a positive number of seconds, got {call_timeout!r}")


def check_state(state: Any, scaler_state: Any, state_type: type, master_numel: int, tx_leaves, tx_spec, *,
                master_dtype: torch.dtype, compiled: bool) -> None:
    """``state``/``scaler_state`` must be what this engine's ``init``/``step`` returned: a
    ``state_type`` whose master is ``[master_numel]`` of ``master_dtype`` (its storage's,
    ``fzero.storage``: the FP32 shard, the int16 remainder of ``master="remainder"``, or empty
    with ``master="params"``) and whose transform state
    has the ``tx_leaves`` ``(path, shape, dtype)`` and structure ``tx_spec`` that ``init`` built
    (static facts only: no host sync, nothing traced; ``compiled``: traced by ``torch.compile``)."""
    if not isinstance(state, state_type):
        raise TypeError(f"state must be the {state_type.__name__} from this engine's init/step, got {type(state).__name__}")
    if not isinstance(scaler_state, LossScaleState):
        raise TypeError(f"scaler_state must be the LossScaleState from this engine's init/step, "
                        f"got {type(scaler_state).__name__}")
    m = state.master
    if not isinstance(m, torch.Tensor) or m.shape != (master_numel,) or m.dtype != master_dtype:
        raise ValueError(f"state.master is {_describe(m)}, this engine's is ({master_numel},) {master_dtype}: "
                         "the state of another engine (another model, world size, layout or master=)?")
    # Dynamo cannot trace a PyTreeSpec comparison; compiled, the leaves are still checked. The
    # leaves' paths are built only for an error: traced, optree's calls are interpreted bytecode
    # by bytecode, and the paths were a large part of what dynamo traced of a step
    # (benchmarks/results/history/compile_time.md).
    if compiled:
        leaves = tree_leaves(state.tx_state)
    else:
        leaves, spec = optree.tree_flatten(state.tx_state)
        if spec != tx_spec:
            raise ValueError(f"state.tx_state is {spec}, this engine's transform built {tx_spec}: "
                             "the state of another engine (another transform)?")
    if len(leaves) != len(tx_leaves):
        raise ValueError(f"state.tx_state has {len(leaves)} leaves, this engine's transform built {len(tx_leaves)}: "
                         "the state of another engine (another transform)?")
    if any(not isinstance(x, torch.Tensor) or x.shape != shape or x.dtype != dtype
           for x, (_, shape, dtype) in zip(leaves, tx_leaves)):
        paths = leaf_paths(state.tx_state)[0]
        diff = first_difference([(p, _describe(x)) for p, x in zip(paths, leaves)],
                                [(p, f"shape {tuple(shape)} {dtype}") for p, shape, dtype in tx_leaves])
        raise ValueError(f"state.tx_state {diff}: the state of another engine (another transform or layout)?")


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
        if leaf.is_meta:
            raise ValueError(f"params leaf {path!r} is on the meta device (a shape without values): materialize "
                             "the params first (e.g. module.to_empty(device=...), then initialize them)")
        device = device or leaf.device
        if leaf.device != device:
            raise ValueError(f"params leaf {path!r} is on {leaf.device}, other leaves on {device}")
    _check_untied(paths, leaves)


def _check_untied(paths: list[str], leaves: list[torch.Tensor]) -> None:
    """No two leaves may share memory: each leaf gets its own place in the flat buffer and its
    own master, so tied weights (one tensor under two paths) would silently train apart."""
    shared = shared_memory(leaves)
    if shared is not None:
        i, j = shared
        raise ValueError(f"params leaves {paths[i]!r} and {paths[j]!r} share memory (tied weights?): fzero gives "
                         "each leaf its own master, so they would train apart. Keep one leaf and use it in both "
                         "places in the model's apply.")


def first_difference(got: list[tuple[str, str]], want: list[tuple[str, str]]) -> str | None:
    """The first difference between two lists of ``(leaf path, description)``, worded for an
    error ("leaf 2 is 'b', expected 'w'"; "leaf 'mu' is shape (3,), expected shape (4,)"; "2
    leaves, expected 3"), or ``None``: the one way fzero names a mismatched leaf."""
    for i, ((gp, gd), (wp, wd)) in enumerate(zip(got, want)):
        if gp != wp:
            return f"leaf {i} is {gp!r}, expected {wp!r}"
        if gd != wd:
            return f"leaf {gp!r} is {gd}, expected {wd}"
    if len(got) != len(want):
        return f"{len(got)} leaves, expected {len(want)}"
    return None


def _describe(x: Any) -> str:
    return f"shape {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def check_like_layout(
    tree: Any, layout: Layout, *, what: str, device: torch.device, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Check ``tree`` has the layout's structure and shapes, floating leaves of ``dtype`` (if
    given) on ``device``, none requiring grad; return its leaves. ``what`` names the argument
    in errors ("grads", "params"). Non-contiguous leaves are fine: every leaf is copied."""
    leaves = optree.tree_leaves(tree)
    # Dynamo cannot trace a PyTreeSpec comparison; a compiled step still checks the leaf count
    # and every shape below, and guards on the structure it was traced with.
    if len(leaves) != len(layout.paths) or (not compiling() and optree.tree_structure(tree) != layout.treespec):
        paths = leaf_paths(tree)[0]
        diff = first_difference([(p, "") for p in paths], [(p, "") for p in layout.paths])
        raise ValueError(f"{what} structure differs from params: {diff or 'the container types differ'}")
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
