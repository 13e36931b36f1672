"""What a transform is told about the params it runs on: ``ShardContext`` (the tensor stands for
a shard of a params pytree), its ``Split`` by leaf, and ``resolve_per_leaf`` for per-leaf settings.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

__all__ = ["ShardContext", "Split", "resolve_per_leaf"]


class ShardContext:
    """What a transform gets as ``context=`` when the tensor it runs on is not the params pytree
    but stands for (a shard of) it, e.g. one rank's flat FP32 shard under fzero's engine.
    ``None`` (the default) means the params are the pytree itself. ``init`` always gets it; a
    transform that declares ``needs_context`` gets the same context in every ``update`` too.

    ``tree``: the params pytree the tensor stands for (shapes matter; values may be
    placeholders), what a mask callable is applied to; leaves the tensor holds nothing of are
    ``None``. ``to_shard(per_leaf)``: a pytree like ``tree`` of per-leaf values (bools, or bool
    tensors broadcastable to each leaf) -> a bool tensor laid out like the tensor.

    Two more methods serve transforms that are not elementwise (``partition``, Muon); this base
    class, for callers that only lay out masks, raises ``NotImplementedError`` in both:

    * ``split(labels_of) -> Split``: the tensor's elements grouped by the label of their leaf
      (``labels_of(tree)``: one string per leaf of ``tree``, in leaf order; called once, the
      same ``labels_of`` then gives the same ``Split``), each group compacted into a tensor of
      its own with a context of its own;
    * ``whole(x, fn, *, dtype=None)``: ``x`` laid out like the tensor -> a tensor laid out the
      same, in ``dtype`` (default ``x.dtype``), where each leaf's elements are those of
      ``fn(that leaf of x, whole, in its shape)`` (padding: zero). The caller gathers each leaf
      whole however it holds them (fzero: through its communicator); the transform stays
      blind to ranks;
    * ``leaf_norms(*xs)``: tensors laid out like the tensor -> for each, an FP32 tensor laid out
      the same where every element holds the L2 norm of its whole leaf of that ``x`` (padding:
      zero): LAMB's per-leaf norms. The caller sums each leaf's squares over the ranks that
      hold a part of it (fzero: one all-reduce of ``len(xs)`` values per leaf)."""

    def __init__(self, tree: Any, to_shard: Callable[[Any], torch.Tensor]):
        self.tree, self.to_shard = tree, to_shard

    def split(self, labels_of) -> "Split":
        raise NotImplementedError(f"{type(self).__name__} cannot group the elements by leaf (split)")

    def whole(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], *, dtype=None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} cannot gather whole leaves (whole)")

    def leaf_norms(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError(f"{type(self).__name__} cannot reduce over whole leaves (leaf_norms)")


class Split(NamedTuple):
    """``ShardContext.split``'s result. ``parts``: ``{label: ShardContext}`` of each group's
    compacted tensor (labels no leaf has are absent); ``take(x)``: ``x`` laid out like the
    split tensor -> ``{label: that group's compacted tensor}``; ``join(parts)``: the inverse,
    ``{label: tensor}`` for every label of ``parts`` -> one tensor laid out like the split one
    (padding zero)."""

    parts: dict
    take: Callable[[torch.Tensor], dict]
    join: Callable[[dict], torch.Tensor]


def resolve_per_leaf(setting, params, context: ShardContext | None = None):
    """A per-leaf ``setting`` laid out like ``params``, the params a transform runs on.

    ``setting``: a pytree like the params pytree (of bools, or bool tensors broadcastable to
    each leaf), or a callable ``params pytree -> such a pytree``. Without ``context``
    ``params`` is that pytree: the callable is applied to it, and the pytree is returned as
    is. With one, the callable is applied to ``context.tree`` and the result goes through
    ``context.to_shard`` (a tensor like ``params``). Call it in ``init``, once."""
    tree = params if context is None else context.tree
    value = setting(tree) if callable(setting) else setting
    return value if context is None else context.to_shard(value)
