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

from .layout import Layout

__all__ = ["grad_and_value"]


def grad_and_value(
    fn: Callable[[Any], tuple[torch.Tensor, Any]],
    params: Any,
    layout: Layout,
    buffers: list[torch.Tensor],
    start_bucket: Callable[[torch.Tensor, int], Any],
    wait: Callable[[Any, int], torch.Tensor],
) -> tuple[list[torch.Tensor], Any]:
    """``(parts, value)`` where ``(loss, value) = fn(params)`` and ``parts[i] = wait(start_bucket(
    buffers[i], i), i)``: backward of ``loss`` writes bucket ``i``'s grads into ``buffers[i]``
    (its ``[N*S_b]`` buffer, any float dtype, given up to this call), and ``start_bucket`` is
    called during backward, as soon as the bucket is complete (see module doc). ``params``: a
    pytree laid out by ``layout``; ``loss`` a 0-d tensor.

    Raises ``ValueError`` before any bucket starts when no leaf reaches ``loss``: a loss
    computed from other tensors than ``params`` (a module's own weights) would otherwise give
    zero grads without a word. Eager only: under ``torch.compile`` compile the whole train step
    instead and let inductor schedule."""
    sizes = [math.prod(s) for s in layout.shapes]
    buffers = list(buffers)  # emptied as the buckets start; the caller's list stays as it was
    # detach() aliases the param's memory: a new autograd leaf, no copy
    leaves = [x.detach().requires_grad_() for x in layout.treespec.flatten_up_to(params)]
    bucket_of, pos_in, missing = {}, {}, []
    for k, b in enumerate(layout.buckets):
        buffers[k][b.numel :].zero_()  # padding; the leaves' part is written by the hooks
        missing.append(set(b.leaves))
        for i in b.leaves:
            bucket_of[i], pos_in[i] = k, layout.offsets[i] - b.start
    started: list[Any] = [None] * len(layout.buckets)
    next_bucket = 0  # buckets before it are started; it starts once complete (module doc)
    arrived = 0  # leaves whose grads backward produced

    def arrive(i: int, grad: torch.Tensor | None) -> None:
        nonlocal next_bucket
        k = bucket_of[i]
        if i in missing[k]:  # its first grad
            dst = buffers[k][pos_in[i] : pos_in[i] + sizes[i]]
            dst.copy_(grad.reshape(-1)) if grad is not None else dst.zero_()
        elif buffers[k] is not None:  # a second part (reentrant checkpointing): its bucket waits still
            buffers[k][pos_in[i] : pos_in[i] + sizes[i]].add_(grad.reshape(-1))
        else:
            raise RuntimeError(
                f"engine.grad_and_value: param leaf {layout.paths[i]!r} got a second part of "
                f"its grad after its bucket's reduce-scatter started: a param used inside a reentrant activation "
                "checkpoint (torch.utils.checkpoint(..., use_reentrant=True)) and outside it, or in two of them, "
                "gets its grad from separate backward passes. Use use_reentrant=False (HF: "
                "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))")
        missing[k].discard(i)
        while next_bucket < len(buffers) and not missing[next_bucket]:
            started[next_bucket] = start_bucket(buffers[next_bucket], next_bucket)
            buffers[next_bucket] = None  # the collective holds it now
            next_bucket += 1

    def on_grad(i: int):
        def hook(leaf: torch.Tensor) -> None:
            nonlocal arrived
            arrived += 1
            arrive(i, leaf.grad)
            leaf.grad = None  # copied: free it now, not at the end of backward
        return hook

    handles = [leaf.register_post_accumulate_grad_hook(on_grad(i)) for i, leaf in enumerate(leaves)]
    try:
        with torch.enable_grad():
            loss, value = fn(layout.treespec.unflatten(leaves))
            if loss.requires_grad:
                # Not ``inputs=leaves``: reentrant activation checkpointing (HF's default) refuses
                # a backward that names its inputs. The leaves are fresh, nothing else holds them.
                loss.backward()
    finally:
        for h in handles:
            h.remove()
    if not arrived:  # nothing started yet: every rank's misuse raises before a collective
        raise ValueError(f"engine.grad_and_value: none of the {len(leaves)} param leaves reached the loss (no "
                         "grad flowed to any of them): did the function call the module instead of `apply`? "
                         "The loss must be computed from the params it is given as its first argument")
    for k in range(len(layout.buckets)):  # leaves that got no grad on this rank: zero
        for i in sorted(missing[k]):
            arrive(i, None)
    return [wait(x, k) for k, x in enumerate(started)], value  # bucket k's reduce, finished
