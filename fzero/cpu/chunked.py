"""The eager update of a CPU shard, chunk by chunk: each op of the update allocates a temporary,
and at shard size those are fresh pages from the OS every op, where at ``chunk_numel`` they stay
in cache and the allocator reuses them (the eager step's times either way: docs/performance.md).
A transform with a fused form runs its kernel the same way, chunk by chunk, reading the grads a
chunk at a time. The variants share ``fzero.update``'s signature.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from fzero.transforms import FusedStep

from ..blocks import is_shard, sized, slices
from ..cast import NewTensor
from ..update import CompiledUpdate, ShardGrads, fused_inputs, fused_slice, fused_state, run_fused, update_into

__all__ = ["fused_chunks", "generic_chunks", "compiled_chunks", "FusedChunks", "Chunks", "CompiledChunks"]


def fused_chunks(tx, fused: FusedStep, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk,
                 donate, out, compiled=None, cast=True):
    """torch's fused kernel (one pass over master, grads and moments) chunk by chunk, in place on
    ``master`` and ``tx_state`` (or on copies of their ``[S]`` tensors), reading the grads a chunk
    at a time (``Segments.fp32``), each chunk cast into ``out`` right after (``cast=False``: the
    master is the params, ``master="params"``, written already)."""
    g, S = grads.segments(), master.numel()
    # Chunks (a CPU's) stay in cache: there each chunk's spent FP32 grads take the saturation
    # before the cast (``cast_params``' ``scratch``), 6 B/elem more of traffic in cache, where a
    # whole shard (a GPU's) would pay them in memory.
    saturate_in_grads = chunk is not None
    # Whole multiples of 64 elements: the kernel's vector loop and its scalar tail round
    # differently, so chunk edges elsewhere would change results.
    chunk = S if chunk is None else max(64, chunk // 64 * 64)
    master, tx_state = fused_inputs(master, tx_state, donate)
    out = torch.empty(S, dtype=param_dtype, device=master.device) if out is None else out
    # Every chunk's views made up front (a tree_map per chunk costs more than a small kernel).
    leaves, spec = optree.tree_flatten(tx_state)
    cut = lambda x: x.split(chunk)  # noqa: E731
    parts = [cut(x) if is_shard(x, S) else None for x in leaves]
    for i, (m, o) in enumerate(zip(cut(master), cut(out))):
        state_chunk = spec.unflatten([x if v is None else v[i] for x, v in zip(leaves, parts)])
        fused_slice(fused, g, i * chunk, m, state_chunk, o, param_dtype, cast=cast,
                    saturate_in_grads=saturate_in_grads)
    return master, fused_state(tx_state, fused, S), out


def generic_chunks(tx, fused, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk, donate, out,
                   compiled=None):
    """``tx.update`` chunk by chunk, written into full-size outputs (the inputs' own buffers with
    ``donate``): eager, each op's temporary stays cache-sized, the grads' mean included."""
    return _by_chunks(update_into, tx, grads, master, tx_state, skip, norm, param_dtype=param_dtype, chunk=chunk,
                      donate=donate, out=out)


def compiled_chunks(tx, fused, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk, donate,
                    out, compiled):
    """``generic_chunks`` with each chunk's update compiled by ``torch.compile`` (inductor: one
    loop per chunk instead of one eager op after another), for state torch's fused kernels
    cannot take: BF16 or 8-bit moments. Compiled once per chunk shape in each engine
    (``compiled``): the first step pays for it, as torchao's ``AdamW8bit`` compiles its
    per-parameter step (``benchmarks/moments.py``). Chunks are whole blocks, so the results do not
    depend on the chunking. The compiled update writes its results into the chunk's slices of the
    outputs, which are cut outside the graph and passed in (``update_into``): cut inside the
    graph, inductor (torch 2.13, CPU) left some of them unwritten; returned and copied eagerly,
    the eager 8-bit step was markedly slower (``benchmarks/moments.py``, docs/performance.md;
    ``tests/test_update.py`` holds the results to the eager ones, whatever the chunking)."""
    return _by_chunks(compiled.into, tx, grads, master, tx_state, skip, norm, param_dtype=param_dtype,
                      chunk=chunk, donate=donate, out=out)


def _by_chunks(update_into, tx, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk, donate,
               out):
    """``update_into`` (``update_into`` or its compiled form) chunk by chunk, into full-size
    outputs made before the first chunk: the inputs' own buffers with ``donate`` (each chunk then
    reads and writes the same slices, passed once)."""
    S, block, device = master.numel(), tx.block, master.device
    full = lambda x: (x if donate else torch.empty_like(x)) if sized(x, S, block) else x  # noqa: E731
    outs = (full(master), optree.tree_map(full, tx_state), torch.empty(S, dtype=param_dtype, device=device)
            if out is None else out)
    scalars = None
    for lo, hi in _chunks(S, chunk, block):
        cut = slices(outs, S, block, lo, hi)
        master_in, state_in = cut[:2] if donate else (master[lo:hi], slices(tx_state, S, block, lo, hi))
        scalars = update_into(tx, grads.mean(device, lo, hi), master_in, state_in, skip, norm, param_dtype, cut)
    # the [S] and per-block tensors written, the 0-d leaves as the last chunk computed them
    scalars = iter(scalars)
    return outs[0], optree.tree_map(lambda o: o if sized(o, S, block) else next(scalars), outs[1]), outs[2]


def _chunks(S: int, chunk: int | None, block: int = 1):
    """``(lo, hi)`` of consecutive chunks of ``chunk`` elements (rounded down to whole
    ``block``s, at least one) covering ``[0, S)``."""
    step = S if not chunk else max(block, chunk // block * block)
    return [(lo, min(S, lo + step)) for lo in range(0, S, step)] or [(0, 0)]


class Chunks(NamedTuple):
    """``generic_chunks`` in chunks of ``chunk`` elements."""

    param_dtype: torch.dtype
    donate: bool
    chunk: int
    target: Any = NewTensor()

    def run(self, tx, grads, master, tx_state, skip, norm):
        return generic_chunks(tx, None, grads, master, tx_state, skip, norm, param_dtype=self.param_dtype,
                              chunk=self.chunk, donate=self.donate, out=self.target.out(master))


class CompiledChunks(NamedTuple):
    """``compiled_chunks`` in chunks of ``chunk`` elements, with the engine's ``compiled`` updates."""

    param_dtype: torch.dtype
    donate: bool
    chunk: int
    compiled: CompiledUpdate
    target: Any = NewTensor()

    def run(self, tx, grads, master, tx_state, skip, norm):
        return compiled_chunks(tx, None, grads, master, tx_state, skip, norm, param_dtype=self.param_dtype,
                               chunk=self.chunk, donate=self.donate, out=self.target.out(master),
                               compiled=self.compiled)


class FusedChunks(NamedTuple):
    """``fused_chunks`` in chunks of ``chunk`` elements where the transform gives its fused form
    for this step (``fzero.update.Fused``), else ``fallback``."""

    param_dtype: torch.dtype
    donate: bool
    chunk: int
    state_device: torch.device
    fallback: Any
    target: Any = NewTensor()

    def run(self, tx, grads, master, tx_state, skip, norm):
        return run_fused(self, fused_chunks, self.chunk, tx, grads, master, tx_state, skip, norm)
