"""The transform state's tensors of an ``[S]`` shard cut to a slice of it: ``[S]`` tensors
elementwise, per-block ones (``GradientTransformation.block``: 8-bit moments' scales) by block."""
from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = ["is_shard", "per_block", "sized", "slices"]


def is_shard(x: Any, S: int) -> bool:
    """Whether ``x`` is a state tensor of the shard's own shape, ``[S]`` (one value per element)."""
    return isinstance(x, torch.Tensor) and x.shape == (S,)


def per_block(x: Any, S: int, block: int) -> bool:
    """Whether ``x`` is a per-block state tensor of an ``[S]`` shard: ``[ceil(S / block)]`` (one
    value per ``block`` elements, ``GradientTransformation.block``; the engine's shards are whole
    blocks, a tensor of another size ends in a partial one)."""
    return block > 1 and isinstance(x, torch.Tensor) and x.shape == (-(-S // block),)


def sized(x: Any, S: int, block: int) -> bool:
    """Whether ``x`` is a state tensor the size of the shard: ``[S]``, or per-block."""
    return is_shard(x, S) or per_block(x, S, block)


def slices(tree: Any, S: int, block: int, lo: int, hi: int) -> Any:
    """``tree`` with each ``[S]`` tensor cut to ``[lo:hi]`` and each per-block one to
    ``[lo/block : hi/block]`` (``lo``, ``hi``: block edges or ``S``); 0-d leaves as they are."""
    def cut(x):
        if is_shard(x, S):
            return x[lo:hi]
        return x[lo // block: -(-hi // block)] if per_block(x, S, block) else x

    return optree.tree_map(cut, tree)
