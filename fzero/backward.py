"""Reduce-scatter inside backward: each bucket's grads leave for their owners while backward
still computes the grads of the buckets before it.

Mechanism (chosen over inductor reordering, which on torch 2.13 CPU issues every collective
after the last backward kernel, see ``benchmarks/overlap.py``): for one call, the params are
fresh autograd *leaves* that alias the param tensors (``detach``: no copy). Backward runs with
``inputs=`` those leaves; autograd executes a leaf's ``AccumulateGrad`` as soon as the leaf's
grad is complete (those nodes have top priority in its ready queue), and a post-accumulate
hook copies the grad into its bucket's ``[N*S_b]`` buffer (in the reduce dtype: this is the
flatten, done once per leaf) and drops it. When a bucket's last leaf arrives, its functional
reduce-scatter starts, and stays in flight while backward goes on; only the final ``wait``
blocks. With buckets filled in reverse leaf order (``fzero.flat``) the first buckets fill
first. This is DDP's and Megatron's design, per call instead of per module: nothing (hooks,
buffers, leaves) outlives the call.

(An identity ``autograd.Function`` per bucket in front of the leaves was tried first: its
backward only runs at the very end, because autograd's ready queue orders nodes by creation
and those nodes are created first in forward.)

Buckets are started strictly in bucket order, each as soon as it and every bucket before it
are complete (DDP's reducer does the same). Collectives are matched across ranks by the order
they are issued in, and the order grads complete in is not the same on every rank: a leaf that
one rank's loss does not use, or a graph that differs by rank, completes its bucket at the end
of backward on that rank only. Started as they completed, bucket ``k`` of one rank would meet
bucket ``j`` of another: wrong sums of equal-sized buckets, an abort for unequal ones. Leaves
that get no grad (unused on this rank) count as zero; buckets still waiting for them start
after backward. Where every rank's grads complete in bucket order (buckets are filled in
reverse leaf order, the order backward usually produces them), nothing waits.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .flat import Layout, concat

__all__ = ["grad_and_value"]


def grad_and_value(
    fn: Callable,
    params: Any,
    layout: Layout,
    start_bucket: Callable[[torch.Tensor, int], torch.Tensor],
    wait: Callable[[torch.Tensor, int], torch.Tensor],
    args: tuple,
    kwargs: dict,
    *,
    dtype: torch.dtype,
    has_aux: bool = False,
) -> tuple[torch.Tensor, Any]:
    """``(shard, value)``: ``value = fn(params, *args, **kwargs)``; ``shard`` = the concatenated
    ``[S_b]`` results of ``start_bucket(grads of bucket i as [N*S_b] in dtype, i)``, each
    started during backward (see module doc) and finished by ``wait(its result, i)``. ``params``:
    a pytree laid out by ``layout``.

    ``fn`` returns a 0-d loss, or ``(loss, aux)`` with ``has_aux``. Eager only: under
    ``torch.compile`` compile the whole train step instead and let inductor schedule."""
    sizes = [math.prod(s) for s in layout.shapes]
    # detach() aliases the param's memory: a new autograd leaf, no copy
    leaves = [x.detach().requires_grad_() for x in layout.treespec.flatten_up_to(params)]
    device = leaves[0].device
    bucket_of, pos_in = {}, {}
    buffers, missing = [], []
    for k, b in enumerate(layout.buckets):
        buf = torch.empty(layout.world_size * b.shard, dtype=dtype, device=device)
        buf[b.numel :].zero_()  # padding; the leaves' part is written by the hooks
        buffers.append(buf)
        missing.append(set(b.leaves))
        for i in b.leaves:
            bucket_of[i], pos_in[i] = k, layout.offsets[i] - b.start
    started: list[Any] = [None] * len(layout.buckets)
    next_bucket = 0  # buckets before it are started; it starts once complete (module doc)

    def arrive(i: int, grad: torch.Tensor | None) -> None:
        nonlocal next_bucket
        k = bucket_of[i]
        dst = buffers[k][pos_in[i] : pos_in[i] + sizes[i]]
        dst.copy_(grad.reshape(-1)) if grad is not None else dst.zero_()
        missing[k].discard(i)
        while next_bucket < len(buffers) and not missing[next_bucket]:
            started[next_bucket] = start_bucket(buffers[next_bucket], next_bucket)
            buffers[next_bucket] = None  # the collective holds it now
            next_bucket += 1

    def on_grad(i: int):
        def hook(leaf: torch.Tensor) -> None:
            arrive(i, leaf.grad)
            leaf.grad = None  # copied: free it now, not at the end of backward
        return hook

    handles = [leaf.register_post_accumulate_grad_hook(on_grad(i)) for i, leaf in enumerate(leaves)]
    try:
        with torch.enable_grad():
            out = fn(layout.treespec.unflatten(leaves), *args, **kwargs)
            loss = out[0] if has_aux else out
            if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
                got = type(loss).__name__ + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                raise TypeError(f"fn must return a 0-d floating loss{' as (loss, aux)' if has_aux else ''}, got {got}")
            loss.backward(inputs=leaves)
    finally:
        for h in handles:
            h.remove()
    for k in range(len(layout.buckets)):  # leaves that got no grad on this rank: zero
        for i in sorted(missing[k]):
            arrive(i, None)
    parts = [wait(x, k) for k, x in enumerate(started)]  # bucket k's reduce, finished
    shard = concat(parts)
    value = (loss.detach(), out[1]) if has_aux else loss.detach()
    return shard, value
