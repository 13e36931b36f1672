"""Walking a transform state or a params pytree: its NamedTuple nodes, and its leaves' paths."""
from __future__ import annotations

from typing import Any

import optree

__all__ = ["named_tuples", "leaf_paths", "map_leaves"]


def named_tuples(tree):
    """Yield every NamedTuple node of ``tree`` (depth first): the state NamedTuples of a
    transform state, e.g. to find its ``MaskedState`` nodes."""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        yield tree
    if isinstance(tree, (tuple, list)):
        for child in tree:
            yield from named_tuples(child)
    elif isinstance(tree, dict):
        for child in tree.values():
            yield from named_tuples(child)


def _entry_name(entry: Any) -> str:
    field = getattr(entry, "field", None)  # a NamedTuple field or an attribute: by name
    return str(entry.entry if field is None else field)


def leaf_paths(tree: Any) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """``(paths, leaves, treespec)`` with paths like ``"blocks/0/attn/qkv_w"``: dict keys,
    sequence indices and NamedTuple field names (``"tx_state/0/mu"``) joined by ``/``; the one
    way fzero names a leaf, in errors and in checkpoints (``fzero.checks``, ``fzero.checkpoint``)."""
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree)
    return ["/".join(_entry_name(e) for e in acc) or "<root>" for acc in accessors], leaves, spec


def map_leaves(fn, tree: Any, *rest: Any, outputs: int) -> tuple:
    """``fn`` on each leaf of ``tree`` with what stands at that leaf in each of ``rest`` (each
    flattened up to ``tree``'s structure: under an update leaf a state may hold a node, e.g. a
    ``Quantized`` or ``Factored`` moment), ``fn`` returning ``outputs`` values per leaf:
    ``outputs`` trees with ``tree``'s structure (a transform's new updates and state pieces)."""
    spec = optree.tree_structure(tree)
    out = [fn(*x) for x in zip(spec.flatten_up_to(tree), *(spec.flatten_up_to(r) for r in rest))]
    return tuple(spec.unflatten([o[k] for o in out]) for k in range(outputs))
