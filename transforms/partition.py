"""``partition``: a different transform for each group of leaves (optax's ``partition``, the
successor of ``multi_transform``), e.g. Muon for hidden matrices and AdamW for the rest.

Each leaf has a label; ``transforms_by_label[label]`` updates the leaves with that label, and
keeps state for those leaves only: it sees the params pytree with every other leaf replaced by
``None`` (an empty node to optree, so its ``tree_map`` skips it), the same structure otherwise,
so a mask callable of an inner transform (``weight_decay_mask``) still sees the leaves' places.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple

import optree

from .protocol import GradientTransformation
from .context import ShardContext
from .tree import leaf_paths

__all__ = ["PartitionState", "partition"]


class PartitionState(NamedTuple):
    """``inner_states``: ``{label: state}``, each the state of ``transforms_by_label[label]``
    over the leaves with that label (a transform no leaf uses keeps the state of no leaves)."""

    inner_states: dict


def partition(transforms_by_label: Mapping[str, GradientTransformation], labels: Any | Callable[[Any], Any]
              ) -> GradientTransformation:
    """Update the leaves labelled ``k`` with ``transforms_by_label[k]``.

    ``labels``: a pytree with the params' structure whose leaves are strings (keys of
    ``transforms_by_label``), or a callable ``params -> such a pytree``; resolved from the
    params at ``init`` and from the updates at ``update`` (they share the structure), e.g.
    ``lambda p: optree.tree_map(lambda x: "muon" if x.ndim == 2 else "adamw", p)``. A label
    that is not a key, a labels pytree of another structure, or a key that is not a string
    raises ``ValueError`` naming the leaf. ``hyperparams`` are each member's, named
    ``"{label}/{name}"`` (``"muon/lr"``).

    On a flat tensor standing for the params (fzero's engine: a rank's shard), ``context``
    groups its elements by label (``ShardContext.split``): each transform runs on its group's
    elements compacted into one tensor, and keeps state of that size."""
    transforms_by_label = dict(transforms_by_label)
    for key, tx in transforms_by_label.items():
        if not isinstance(key, str):
            raise ValueError(f"partition: labels must be strings, got key {key!r} ({type(key).__name__})")
        if not isinstance(tx, GradientTransformation):
            raise ValueError(f"partition: transforms_by_label[{key!r}] must be a GradientTransformation, got "
                             f"{type(tx).__name__}")

    def leaf_labels(tree) -> tuple[list, Any]:
        """``tree``'s leaves' labels in leaf order, checked, and its treespec."""
        spec = optree.tree_structure(tree)
        given = labels(tree) if callable(labels) else labels
        try:
            out = spec.flatten_up_to(given)
        except (ValueError, TypeError) as e:
            raise ValueError(f"partition: the labels must have the params' structure ({spec}): {e}") from None
        for name, label in zip(leaf_paths(tree)[0], out):
            if not isinstance(label, str) or label not in transforms_by_label:
                raise ValueError(f"partition: leaf {name!r} has label {label!r}, which is not one of "
                                 f"{sorted(transforms_by_label)}")
        return out, spec

    def only(leaves, spec, tags, label):
        """The tree of ``leaves`` with those not labelled ``label`` replaced by ``None``."""
        return spec.unflatten([x if t == label else None for x, t in zip(leaves, tags)])

    def init(params, *, context: ShardContext | None = None):
        if context is not None:
            parts = _split(context)
            taken = parts.take(params)
            nothing = optree.tree_map(lambda _: None, context.tree)  # a label no leaf has: a state of no leaves
            return PartitionState({k: tx.init(taken[k], context=parts.parts[k]) if k in parts.parts else
                                   tx.init(nothing) for k, tx in transforms_by_label.items()})
        tags, spec = leaf_labels(params)
        leaves = spec.flatten_up_to(params)
        return PartitionState({k: tx.init(only(leaves, spec, tags, k)) for k, tx in transforms_by_label.items()})

    def tags_of(tree) -> list:
        """The labels of ``tree``'s leaves, checked; a group's state must align to its blocks."""
        tags = leaf_labels(tree)[0]
        for k, tx in transforms_by_label.items():
            if tx.block != 1 and k in tags:
                raise ValueError(f"partition: transforms_by_label[{k!r}] keeps state in blocks of {tx.block} "
                                 "elements (8-bit moments), which a group's compacted shard does not align to; "
                                 "use mu_dtype/nu_dtype of torch.bfloat16 or FP32 moments inside a partition")
        return tags

    def _split(context: ShardContext):
        """The context's tensor split by label (each group's leaves compacted: ``Split``); the
        context works it out once (the labels resolved at ``init``, not traced at each step)."""
        return context.split(tags_of)

    def update(updates, state, params=None, *, context: ShardContext | None = None, **extra):
        if context is not None:  # a flat tensor standing for the params: each group compacted
            parts = _split(context)
            grads, mine = parts.take(updates), None if params is None else parts.take(params)
            new = {}
            inner = dict(state.inner_states)
            for k, sub in parts.parts.items():
                new[k], inner[k] = transforms_by_label[k].update(grads[k], state.inner_states[k],
                                                                 None if mine is None else mine[k], context=sub, **extra)
            return parts.join(new), PartitionState(inner)
        tags, spec = leaf_labels(updates)
        out = spec.flatten_up_to(updates)
        param_leaves = None if params is None else spec.flatten_up_to(params)
        inner = {}
        for k, tx in transforms_by_label.items():
            sub_params = None if params is None else only(param_leaves, spec, tags, k)
            # out's leaves labelled k are still the given updates: only other labels' were replaced
            new, inner[k] = tx.update(only(out, spec, tags, k), state.inner_states[k], sub_params, **extra)
            mine = iter(optree.tree_leaves(new))
            out = [next(mine) if t == k else u for u, t in zip(out, tags)]
        return spec.unflatten(out), PartitionState(inner)

    def hyperparams(state):
        return {f"{k}/{name}": v for k, tx in transforms_by_label.items() if tx.hyperparams
                for name, v in tx.hyperparams(state.inner_states[k]).items()}

    hyper = hyperparams if any(tx.hyperparams for tx in transforms_by_label.values()) else None
    block = math.lcm(*(tx.block for tx in transforms_by_label.values())) if transforms_by_label else 1
    # Always: on a flat tensor it groups the elements by leaf, whatever its members are.
    return GradientTransformation(init, update, None, hyper, block, needs_context=True)
