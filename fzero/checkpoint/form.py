"""The optimizer state as a checkpoint holds it, and back.

A checkpoint stores every ``[S]`` leaf element by element in global coordinates, which is what
lets it load at any world size. A state node that stores a moment in a form of its own (8-bit
moments, ``transforms.quantize.Quantized``: codes and one scale per block, which follow the saving
engine's layout) says which leaf a checkpoint holds for it (``saved``: the FP32 ``[S]`` value,
named like the moment, ``tx_state/0/0/mu``) and takes it back in the loading engine's form
(``loaded``: quantized again into its own blocks). Moments stored as FP32, BF16 or 8 bits
therefore load into an engine that stores them in any of the three: the loaded moments are the
saved ones as FP32, then stored as the engine stores them (BF16: rounded to nearest; 8 bits:
quantized; ``loaded(saved())`` gives back the codes and scales, so a resume at the same world
size and dtype is exact).

A ``partition``'s state holds each group's elements of the shard only, compacted: a checkpoint
stores each such leaf spread over the whole shard, zero outside its group, so that it too maps
to global coordinates (``ungrouped``), and a load takes each group's elements
back out of it in the loading engine's layout (``regrouped``).

Statistics that every rank holds whole and alike (``transforms.adafactor``'s per-matrix row
and column means, ``is_replicated``) are not in global coordinates but independent of the
world size: a checkpoint stores them once, as they are (``replicated``), and every rank of
any world size loads them whole.
"""
from __future__ import annotations

from typing import Any

import optree

from fzero.transforms.adafactor import is_replicated
from fzero.transforms.partition import PartitionState
from fzero.transforms.quantize import is_stored

from ..shard_view import ShardView

__all__ = ["saved_form", "engine_form", "converts", "replicated", "ungrouped", "regrouped"]

# shard leaves a load converts between (the moment dtypes a checkpoint may hold): a saved
# leaf of one loads into an engine leaf of another
CONVERTIBLE = ("float32", "bfloat16")


def converts(saved: str, engine: str) -> bool:
    """Whether a saved ``[S]`` leaf of dtype ``saved`` (a checkpoint's dtype name) loads into an
    engine leaf of dtype ``engine``: the same dtype, or FP32 and BF16 either way (moments)."""
    return saved == engine or {saved, engine} <= set(CONVERTIBLE)


def replicated(state: Any) -> frozenset:
    """The ``id`` of every tensor of ``state`` that every rank holds whole and alike (in an
    ``is_replicated`` node): the leaves ``manifest.classify`` calls ``"replicated"``."""
    nodes = optree.tree_leaves(state, is_leaf=is_replicated)
    return frozenset(id(x) for node in nodes if is_replicated(node) for x in node)


def saved_form(state: Any, view: ShardView) -> Any:
    """``state`` with every moment stored in a form of its own (``is_stored``: 8-bit) replaced by
    the leaf it says a checkpoint holds (``saved()``, FP32), and every leaf of a ``partition``
    group spread over the shard, zero outside the group (``ungrouped``); ``view``: the engine's
    ``shard_context``. Other leaves as they are, the same tensors."""
    plain = optree.tree_map(lambda x: x.saved() if is_stored(x) else x, state, is_leaf=is_stored)
    return ungrouped(plain, view)


def engine_form(saved: Any, like: Any, view: ShardView) -> Any:
    """The inverse for an engine whose fresh state is ``like``: each group's leaves taken back to
    the group's elements, then each FP32 leaf where ``like`` has a moment stored in a form of its
    own taken back into that form (``like``'s ``loaded``); every other leaf as it is."""
    def back(template, value):
        return template.loaded(value) if is_stored(template) else value

    return optree.tree_map(back, like, regrouped(saved, like, view), is_leaf=is_stored)


def _is_partition(x) -> bool:
    return isinstance(x, PartitionState)


def ungrouped(state: Any, view: ShardView) -> Any:
    """``state`` (a transform state ``init`` built on ``view``, or a tree holding one) with every
    1-D leaf of a ``partition`` group spread over ``view``'s tensor, zero outside the group: the
    ``[S]`` leaves a checkpoint maps to global coordinates. Other leaves are returned as they are.
    A ``partition`` inside a group is spread the same way, level by level."""
    def walk(node, v):
        if not _is_partition(node):
            return node
        split = v.only_split()
        inner = {}
        for k, s in node.inner_states.items():
            if k not in split.parts:  # a label no leaf has: a state of no leaves
                inner[k] = s
                continue
            spread = lambda x: split.join({j: x if j == k else x.new_zeros(p.numel) for j, p in split.parts.items()})  # noqa: E731
            inner[k] = optree.tree_map(lambda x: spread(x) if x.ndim == 1 else x, _walk(s, split.parts[k], walk))
        return PartitionState(inner)

    return _walk(state, view, walk)


def regrouped(saved: Any, like: Any, view: ShardView) -> Any:
    """The inverse of ``ungrouped`` for the state ``like`` (a fresh one, of the same structure):
    each group's 1-D leaves of ``saved``, over ``view``'s tensor, taken back to the group's."""
    def walk(node, template, v):
        if not _is_partition(template):
            return node
        split = v.only_split()
        inner = {}
        for k, s in node.inner_states.items():
            if k not in split.parts:
                inner[k] = s
                continue
            part = split.parts[k]
            taken = optree.tree_map(lambda x: part.take_from_parent(x) if x.ndim == 1 else x, s)
            inner[k] = optree.tree_map(lambda a, b: walk(a, b, part), taken, template.inner_states[k],
                                       is_leaf=_is_partition)
        return PartitionState(inner)

    return optree.tree_map(lambda a, b: walk(a, b, view), saved, like, is_leaf=_is_partition)


def _walk(tree: Any, view: ShardView, walk) -> Any:
    """``walk(node, view)`` on every ``PartitionState`` node of ``tree`` and every other leaf."""
    return optree.tree_map(lambda node: walk(node, view), tree, is_leaf=_is_partition)
