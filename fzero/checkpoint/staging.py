"""What a save writes, taken from the state at the call: borrowed (``save``) or staged (``async_save``).

A rank's part of a snapshot is its shard file -- the real elements of every ``[S]`` state leaf
that it owns (``Layout.owned``), leaf by leaf in file order
(:mod:`fzero.checkpoint.shard_file`), and in the first rank's file the leaves every rank holds
alike (``"replicated"``), whole and flattened -- and, for the manifest, the 0-d leaves and the
loss-scale state. ``save`` writes it while the caller waits, so it *borrows* the state: the
parts are views of the live leaves. ``async_save`` returns before the write, and the caller may
step at once (``donate=True`` writes the state in place), so it *stages* a copy: every part is
copied into one host buffer laid out as the file's data section, the 0-d leaves next to it. The
buffer is allocated at the first ``async_save`` of an engine and reused by the next ones (a
save waits for the one before it); its size is the rank's shard file's data, one more copy of
the rank's ``[S]`` state leaves in host memory.

On CUDA the buffer is pinned (page-locked), so the device-to-host copies run on the DMA engines
(as torch's ``DefaultStager`` and torchtitan's ``async_with_pinned_mem`` stage): issued on a
side stream after the work already queued (the state of the call), they return at once; the
current stream then waits for them (on the device, the host does not wait), so nothing queued
after the call -- the next step's in-place update included -- writes the state before it is
read. The writer thread waits for the copies (``Contents.ready``) before it writes the file.
"""
from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch

from ..scaler import LossScaleState
from .shard_file import Entry, order

__all__ = ["Contents", "StagingBuffer", "borrowed", "staged", "nbytes"]


class Contents(NamedTuple):
    """One rank's part of a snapshot. ``leaves``: every state leaf, for the manifest (its dtype;
    a 0-d leaf's value); ``entries``: the shard file's tensors in file order, and ``parts`` their
    data, each as a list of 1-D tensors to write back to back; ``ready()`` returns once they
    hold the values of the call (staged on CUDA: the copies are done)."""

    names: list[str]
    kinds: list[str]
    leaves: list[torch.Tensor]
    scaler: LossScaleState
    entries: list[Entry]
    parts: dict[str, list[torch.Tensor]]
    segments: list[list[int]]
    ready: Callable[[], None]


def _entries(names, leaves, kinds, owned, whole: bool) -> list[Entry]:
    real = sum(g1 - g0 for g0, g1, _ in owned)
    return order(Entry(name, leaf.dtype, real if kind == "shard" else leaf.numel())
                 for name, leaf, kind in zip(names, leaves, kinds) if kind == "shard" or kind == "replicated" and whole)


def nbytes(names, leaves, kinds, owned, whole: bool = False) -> int:
    """Bytes of the staging buffer for these state leaves (as a checkpoint stores them:
    ``fzero.checkpoint.form.saved_form``; kinds: ``manifest.classify``) and ``owned`` ranges: the
    real elements of every ``[S]`` leaf in its dtype -- FP32 master and moments 12 bytes per
    element, 8-bit moments dequantized to FP32, a bool mask 1 -- and, with ``whole`` (the first
    rank), every replicated leaf."""
    return sum(e.nbytes for e in _entries(names, leaves, kinds, owned, whole))


def _slices(leaf: torch.Tensor, kind: str, owned) -> list[torch.Tensor]:
    """The elements this rank writes of ``leaf``: of an ``[S]`` leaf the real ones it owns,
    views, one per owned range; a replicated leaf whole, flattened."""
    if kind == "replicated":
        return [leaf.detach().reshape(-1)]
    return [leaf.detach()[p : p + g1 - g0] for g0, g1, p in owned]


def _nothing() -> None:
    pass


def borrowed(names, leaves, kinds, scaler: LossScaleState, owned, whole: bool) -> Contents:
    """The state's own tensors: valid while the state is not changed (``save``, during the call).
    ``whole``: this rank's file holds the replicated leaves (the first rank's)."""
    by_name, kind_of = dict(zip(names, leaves)), dict(zip(names, kinds))
    entries = _entries(names, leaves, kinds, owned, whole)
    parts = {e.name: _slices(by_name[e.name], kind_of[e.name], owned) for e in entries}
    return Contents(names, kinds, leaves, scaler, entries, parts, [[g0, g1] for g0, g1, _ in owned], _nothing)


class StagingBuffer:
    """One rank's host buffer for staged shard data, reused from save to save (module doc)."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 before the first ``async_save``)."""
        return 0 if self.buffer is None else self.buffer.numel()

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """``nbytes`` bytes of it (uint8): the buffer, grown (replaced) if it is smaller or not
        pinned as asked."""
        if self.buffer is None or self.buffer.numel() < nbytes or self.buffer.is_pinned() != pinned:
            self.buffer = None  # freed before the new one is allocated
            self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
        return self.buffer[:nbytes]


def staged(names, leaves, kinds, scaler: LossScaleState, owned, whole: bool, buffer: StagingBuffer) -> Contents:
    """A copy of the state's part in ``buffer`` (and of its 0-d leaves), independent of the state
    from the call on; on CUDA the copies are still in flight when it returns (module doc)."""
    entries = _entries(names, leaves, kinds, owned, whole)
    by_name, kind_of = dict(zip(names, leaves)), dict(zip(names, kinds))
    cuda = [leaf for leaf in leaves if leaf.is_cuda]
    device = cuda[0].device if cuda else None
    data = buffer.take(sum(e.nbytes for e in entries), pinned=device is not None)
    stream = None
    if device is not None:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the state as of the call
    parts, offset = {}, 0
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for e in entries:
            out, at = data[offset : offset + e.nbytes].view(e.dtype), 0
            for part in _slices(by_name[e.name], kind_of[e.name], owned):
                out[at : at + part.numel()].copy_(part, non_blocking=True)
                at += part.numel()
            parts[e.name] = [out]
            offset += e.nbytes
        small = [_small_copy(leaf) if kind == "scalar" else None for leaf, kind in zip(leaves, kinds)]
        scale = LossScaleState(*(_small_copy(v) for v in scaler))
    staged_leaves = [_staged_leaf(parts, n, leaf, kind, s) for n, leaf, kind, s in zip(names, leaves, kinds, small)]
    ready = _nothing
    if stream is not None:
        done = stream.record_event()
        torch.cuda.current_stream(device).wait_event(done)  # nothing queued later writes the state before it is read
        ready = done.synchronize
    return Contents(names, kinds, staged_leaves, scale, entries, parts, [[g0, g1] for g0, g1, _ in owned], ready)


def _staged_leaf(parts: dict, name: str, leaf: torch.Tensor, kind: str, small) -> torch.Tensor:
    """What the manifest reads of a staged leaf (its dtype; a scalar's value, a replicated leaf's
    shape), holding no reference to the state: the copy, or a meta tensor for a replicated leaf
    another rank writes."""
    if kind == "scalar":
        return small
    if name not in parts:
        return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
    return parts[name][0].view(leaf.shape) if kind == "replicated" else parts[name][0]


def _small_copy(t: torch.Tensor) -> torch.Tensor:
    """A 0-d tensor's value in host memory (pinned, copied without a host wait, on CUDA)."""
    if not t.is_cuda:
        return t.detach().clone()
    out = torch.empty((), dtype=t.dtype, pin_memory=True)
    return out.copy_(t.detach(), non_blocking=True)
