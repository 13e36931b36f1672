"""The optimizer state as a checkpoint holds it, and back.

A checkpoint stores every ``[S]`` leaf element by element in global coordinates, which is what
lets it load at any world size. 8-bit moments (``transforms.quantize.Quantized``: codes and one
scale per block) are not elementwise, and their blocks follow the saving engine's layout, so a
checkpoint stores them dequantized, as FP32 ``[S]`` leaves named like the moment
(``tx_state/0/0/mu``); the loading engine quantizes them again into its own blocks. Moments
stored as FP32, BF16 or 8 bits therefore load into an engine that stores them in any of the
three: the loaded moments are the saved ones as FP32, then stored as the engine stores them
(BF16: rounded to nearest; 8 bits: quantized; ``quantize`` of a dequantized moment gives back
its codes and scales, so a resume at the same world size and dtype is exact).

A ``partition``'s state holds each group's elements of the shard only, compacted: a checkpoint
stores each such leaf spread over the whole shard, zero outside its group, so that it too maps
to global coordinates (``fzero.shard_view.ungrouped``), and a load takes each group's elements
back out of it in the loading engine's layout (``regrouped``).
"""
from __future__ import annotations

from typing import Any

import optree
import torch

from fzero.transforms.quantize import Quantized, dequantize, quantize

from ..shard_view import ShardView, regrouped, ungrouped

__all__ = ["saved_form", "engine_form", "converts"]

# shard leaves a load converts between (the moment dtypes a checkpoint may hold): a saved
# leaf of one loads into an engine leaf of another
CONVERTIBLE = ("float32", "bfloat16")


def converts(saved: str, engine: str) -> bool:
    """Whether a saved ``[S]`` leaf of dtype ``saved`` (a checkpoint's dtype name) loads into an
    engine leaf of dtype ``engine``: the same dtype, or FP32 and BF16 either way (moments)."""
    return saved == engine or {saved, engine} <= set(CONVERTIBLE)


def _is_quantized(x: Any) -> bool:
    return isinstance(x, Quantized)


def saved_form(state: Any, view: ShardView) -> Any:
    """``state`` with every ``Quantized`` moment dequantized to FP32 and every leaf of a
    ``partition`` group spread over the shard (``shard_view.ungrouped``: zero outside the
    group); ``view``: the engine's ``shard_context``. Other leaves as they are, the same tensors."""
    plain = optree.tree_map(lambda x: dequantize(x) if _is_quantized(x) else x, state, is_leaf=_is_quantized)
    return ungrouped(plain, view)


def engine_form(saved: Any, like: Any, view: ShardView) -> Any:
    """The inverse for an engine whose fresh state is ``like``: each group's leaves taken back to
    the group's elements, then each FP32 leaf where ``like`` has a ``Quantized`` moment quantized
    on that moment's map; every other leaf as it is."""
    def back(template, value):
        if _is_quantized(template):
            return quantize(value, signed=template.codes.dtype == torch.int8)
        return value

    return optree.tree_map(back, like, regrouped(saved, like, view), is_leaf=_is_quantized)
