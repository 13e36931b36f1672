"""The update on this rank's FP32 shard: transform -> keep the old values where the step is
skipped -> cast to the param dtype.

The transforms are elementwise on the shard (a rank holds arbitrary slices of params, so they
must be; the one global quantity, the grad norm, comes in as an argument), so the shard may be
cut into chunks. Eager, each op of the update allocates a temporary: at shard size those are
fresh pages from the OS every op (924 vs 390 ms for 2e7 elements on a 2-core CPU); at
``chunk_numel`` they stay in cache and the allocator reuses them. Compiled, inductor fuses the
update into one loop, so it runs on the whole shard.
"""
from __future__ import annotations

import math
from typing import Any

import optree
import torch

__all__ = ["update_shard", "sum_of_squares", "owned_fp32", "cast_params", "write_into"]


def cast_params(master: torch.Tensor, dtype: torch.dtype, *, copy: bool = False) -> torch.Tensor:
    """FP32 master values in the param ``dtype``, *saturating*: values beyond the dtype's
    finite range (65504 for FP16) become its largest finite value instead of inf, so a finite
    master never gives a non-finite param. The master keeps the exact value; NaN stays NaN.
    ``copy``: a new tensor even when ``dtype`` is FP32."""
    if dtype == master.dtype:
        return master.clone() if copy else master
    big = torch.finfo(dtype).max
    return master.to(dtype).nan_to_num_(nan=math.nan, posinf=big, neginf=-big)


def write_into(old: Any, new: Any) -> Any:
    """Copy every tensor of ``new`` into the matching tensor of ``old``; return ``old``.

    Under ``torch.compile`` inductor stores the step's results straight into the input
    buffers, so the FP32 state is never held twice."""
    for o, n in zip(optree.tree_leaves(old), optree.tree_leaves(new)):
        if o is not n:  # updated in place already (the fused kernel)
            o.copy_(n)
    return old


def _update(tx, g, master, tx_state, skip, norm, param_dtype):
    """The update of (a chunk of) the shard: ``(master, tx_state, master in param_dtype)``."""
    updates, new_tx_state = tx.update(g, tx_state, master, grad_norm=norm)
    # Skip without a branch: on overflow every state tensor keeps its old bits.
    new_master = torch.where(skip, master, master + updates)
    new_tx_state = optree.tree_map(lambda new, old: torch.where(skip, old, new), new_tx_state, tx_state)
    return new_master, new_tx_state, cast_params(new_master, param_dtype)


def sum_of_squares(g: torch.Tensor, row: int) -> torch.Tensor:
    """``sum(g**2)`` as a 0-d float64, exact for every finite FP32 ``g`` (no square overflows,
    as FP32 squares do above 1.8e19) and non-finite iff ``g`` holds an inf or NaN.

    Row by row: float64 norms of rows of ``row`` elements (a divisor of ``g.numel()``; a CPU
    reduction of the whole vector in float64 casts element by element and runs ~5x slower),
    then their squares summed."""
    return torch.linalg.vector_norm(g.view(-1, row), dim=1, dtype=torch.float64).square().sum()


def owned_fp32(shard: torch.Tensor, owned: bool) -> torch.Tensor:
    """``shard`` in FP32 as a tensor the step may overwrite: a copy unless it is FP32 already
    and ``owned`` (no caller holds it)."""
    g = shard.float()
    return g if owned or g is not shard else g.clone()


def update_shard(tx, g: torch.Tensor, master: torch.Tensor, tx_state: Any, skip: torch.Tensor, norm: torch.Tensor,
                 *, param_dtype: torch.dtype, grad_scale: torch.Tensor | None, chunk_numel: int | None, donate: bool):
    """``(master, tx_state, params shard)`` after one update of transform ``tx`` on the ``[S]``
    shard: ``skip`` 0-d bool (keep every old value), ``norm`` the global grad norm (float64,
    for clipping). ``g``: the FP32 mean grads; with ``grad_scale`` (0-d FP32), the mean grads
    times ``grad_scale``, overwritable, for ``tx.fused``.

    ``tx.fused`` (torch's fused kernel: one pass over master, grads and moments) updates in
    place: the inputs' own buffers with ``donate``, else copies of them. Otherwise -- or if it
    declines -- the generic ``tx.update``; eager on a CPU shard with ``chunk_numel`` it runs
    chunk by chunk, written into full-size outputs (the inputs' own buffers with ``donate``);
    0-d state (the step count) is the same from every chunk. Results do not depend on the
    chunking, and the two ways agree to float rounding."""
    if grad_scale is not None:
        # The kernel writes master and moments in place: without donate, into copies (0-d leaves
        # are replaced, never written, and keep their host values).
        copy = lambda x: x.clone() if isinstance(x, torch.Tensor) and x.ndim and x.is_floating_point() else x
        mine = (master, tx_state) if donate else optree.tree_map(copy, (master, tx_state))
        out = tx.fused(mine[0], g, mine[1], grad_scale=grad_scale, found_inf=skip, grad_norm=norm)
        if out is not None and out[2]:
            return mine[0], out[0], cast_params(mine[0], param_dtype)
        g = g / grad_scale  # declined before touching anything: the generic update
    S = g.numel()
    chunk = chunk_numel if g.device.type == "cpu" else None  # CUDA: its caching allocator reuses memory
    if torch.compiler.is_compiling() or chunk is None or chunk >= S:
        return _update(tx, g, master, tx_state, skip, norm, param_dtype)
    is_shard = lambda x: isinstance(x, torch.Tensor) and x.shape == (S,)
    outs = None
    for lo in range(0, S, chunk):
        part = lambda x: x[lo : lo + chunk] if is_shard(x) else x
        res = _update(tx, g[lo : lo + chunk], master[lo : lo + chunk], optree.tree_map(part, tx_state), skip, norm,
                      param_dtype)
        if outs is None:  # full-size outputs; 0-d leaves as the first chunk computed them
            full = lambda old, new: (old if donate else torch.empty_like(old)) if is_shard(old) else new
            outs = (full(master, res[0]), optree.tree_map(full, tx_state, res[1]),
                    torch.empty(S, dtype=param_dtype, device=g.device))
        for out, new in zip(optree.tree_leaves(outs), optree.tree_leaves(res)):
            if out.shape == (S,):
                out[lo : lo + chunk].copy_(new)
    return outs
