"""Which memory tensors occupy: the one place fzero reads storages, offsets and data pointers.

Ground floor: imports nothing of fzero, so every module may ask it. Eager only -- a tensor that
``torch.compile`` traces is a fake with no memory of its own, so callers ask outside a trace.
"""
from __future__ import annotations

from typing import Any, Sequence

import optree
import torch

__all__ = ["shared_memory", "viewed_buffer", "marked_buffer", "check_in_buffer"]


def shared_memory(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The indices of two of ``tensors`` whose memory overlaps (one tensor twice, or views of
    one storage), or ``None``."""
    spans = sorted((x.untyped_storage().data_ptr() + x.storage_offset() * x.element_size(), i)
                   for i, x in enumerate(tensors) if x.numel() > 0)
    for (lo, i), (next_lo, j) in zip(spans, spans[1:]):
        x = tensors[i]
        if (next_lo < lo + x.numel() * x.element_size()
                and x.untyped_storage().data_ptr() == tensors[j].untyped_storage().data_ptr()):
            return i, j
    return None


def viewed_buffer(leaves: Sequence[torch.Tensor], offsets: Sequence[int], numel: int) -> torch.Tensor | None:
    """The 1-D ``[numel]`` buffer whose views ``leaves`` are, leaf ``i`` starting ``offsets[i]``
    elements into it (the buffer within their storage), or ``None`` if they are not views of
    one such buffer. ``leaves`` must share a dtype (the params' leaves, checked)."""
    storage = leaves[0].untyped_storage()
    start = leaves[0].storage_offset() - offsets[0]
    if start < 0 or storage.nbytes() < (start + numel) * leaves[0].element_size() or any(
        x.untyped_storage().data_ptr() != storage.data_ptr() or x.storage_offset() != start + o
        for x, o in zip(leaves, offsets)
    ):
        return None
    base = leaves[0]._base
    if base is not None and base.shape == (numel,) and base.storage_offset() == start:
        return base
    # e.g. a compiled step's output: the leaves share the buffer but carry no view link
    return leaves[0].new_empty(0).set_(storage, start, (numel,))


def marked_buffer(params: Any) -> torch.Tensor | None:
    """The tensor object that stands for the flat buffer of params an engine returned, without
    walking their leaves: the ``[N*S]`` tensor itself, or the first leaf's ``_base`` (the buffer
    that ``unflatten`` made the leaves views of); ``None`` if there is none. ``fzero.lineage`` marks
    it; the same object comes back as ``viewed_buffer`` of those leaves."""
    if isinstance(params, torch.Tensor):
        return params
    leaves = optree.tree_leaves(params)
    return leaves[0]._base if leaves and isinstance(leaves[0], torch.Tensor) else None


def check_in_buffer(buffer: torch.Tensor, leaves: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``buffer`` lies within its storage and each of ``leaves`` is a
    contiguous view of that storage starting ``offsets[i]`` elements into ``buffer``."""
    storage, size = buffer.untyped_storage(), buffer.element_size()
    if buffer.data_ptr() + buffer.numel() * size > storage.data_ptr() + storage.nbytes():
        raise ValueError(f"params are not views of one flat buffer of {buffer.numel()} elements starting where its "
                         "memory starts: pass the params init/step returned (compiled with donate=True, the step "
                         "casts into their buffer)")
    for i, (x, o) in enumerate(zip(leaves, offsets)):
        if (not x.is_contiguous() or x.untyped_storage().data_ptr() != storage.data_ptr()
                or x.data_ptr() != buffer.data_ptr() + o * size):
            raise ValueError(f"params leaf {i} is not at its offset {o} in the params' flat buffer: pass the params "
                             "init/step returned (compiled with donate=True, the step casts into their buffer)")
