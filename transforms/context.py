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

    More methods serve transforms that are not elementwise (``partition``, Muon, LAMB,
    Adafactor); this base class, for callers that only lay out masks, raises
    ``NotImplementedError`` in each:

    * ``split(labels_of) -> Split``: the tensor's elements grouped by the label of their leaf
      (``labels_of(tree)``: one string per leaf of ``tree``, in leaf order; called once, the
      same ``labels_of`` then gives the same ``Split``), each group compacted into a tensor of
      its own with a context of its own;
    * ``whole(x, fn, *, dtype=None)``: ``x`` laid out like the tensor -> a tensor laid out the
      same, in ``dtype`` (default ``x.dtype``), where each leaf's elements are those of
      ``fn(that leaf of x, whole, in its shape)`` (padding: zero). The caller gathers each leaf
      whole however it holds them (fzero: through its communicator); the transform stays
      blind to ranks;
    * ``leaf_norms(*xs, rms=False)``: tensors laid out like the tensor -> for each, an FP32
      tensor laid out the same where every element holds the L2 norm of its whole leaf of that
      ``x`` (``rms``: the norm over the square root of the leaf's size; padding: zero): LAMB's
      per-leaf norms, Adafactor's RMS. The caller sums each leaf's squares over the ranks that
      hold a part of it (fzero: one all-reduce of ``len(xs)`` values per leaf);
    * ``matrix_means(x)``: ``x`` laid out like the tensor -> for each leaf of ``tree`` (leaf
      order) with 2 or more dims, ``(row, col)``: the means of its whole leaf of ``x`` over each
      row, ``[..., R, 1]``, and over each column, ``[..., 1, C]`` (the last two dims; ``...``
      the leading ones), FP32; ``None`` for the other leaves: Adafactor's factored statistics.
      The caller sums them over the ranks that hold a part of a leaf (fzero: one all-reduce of
      every matrix's rows and columns), so every rank gets them whole and alike;
    * ``outer(factors)``: ``factors`` as ``matrix_means`` returns them (any ``(row, col)``
      of those shapes) -> an FP32 tensor laid out like the tensor whose element ``[..., i, j]``
      of each matrix is ``row[..., i, 0] * col[..., 0, j]`` (other leaves, padding: zero),
      computed only for the elements the tensor holds."""

    def __init__(self, tree: Any, to_shard: Callable[[Any], torch.Tensor]):
        self.tree, self.to_shard = tree, to_shard

    def split(self, labels_of) -> "Split":
        raise NotImplementedError(f"{type(self).__name__} cannot group the elements by leaf (split)")

    def whole(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], *, dtype=None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} cannot gather whole leaves (whole)")

    def leaf_norms(self, *xs: torch.Tensor, rms: bool = False) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError(f"{type(self).__name__} cannot reduce over whole leaves (leaf_norms)")

    def matrix_means(self, x: torch.Tensor) -> list:
        raise NotImplementedError(f"{type(self).__name__} cannot reduce over whole leaves (matrix_means)")

    def outer(self, factors: list) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} cannot lay out per-leaf factors (outer)")


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
