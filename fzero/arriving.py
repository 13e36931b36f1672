"""Params whose all-gather may still be in flight (``zero1(overlap_gather=True)``): each leaf
waits for its bucket at its first use.

An eager step with ``overlap_gather`` returns once it has *issued* the new params' all-gather,
bucket by bucket, the last bucket (the first layers': buckets fill in reverse leaf order) first
(``Comm.start_all_gather_into``). It hands out the leaves as :class:`Arriving` tensors: views of
the flat buffer like any params, whose ``__torch_function__`` lets views and metadata through
without waiting -- what ``fzero.backward`` does to every leaf before the forward (``detach``,
``requires_grad_``, hooks) -- and waits for the leaf's bucket before any call that reads or
writes its memory. A forward thus overlaps the gathers of the buckets it has not reached, and a
user who reads a leaf early (``print(params["w"])``, ``.numpy()``, a step) reads it whole.

Megatron-LM's ``--overlap-param-gather`` waits the same way, in a forward pre-hook per bucket
(``finish_param_sync``), and a read outside the forward is the user's to order; FSDP2 hands out
sharded ``DTensor`` params and gathers them in its pre-forward hooks. Here the wait rides on
the leaf itself, so it needs no module and no hook.

Cost: every call on an ``Arriving`` leaf goes through ``__torch_function__`` (microseconds in
Python), also after its bucket arrived; the step returns new leaves each time. Saved
(``torch.save``, pickle) or deep-copied, a leaf waits and comes out a plain tensor.
"""
from __future__ import annotations

from typing import Any

import optree
import torch

from .comm.communicator import InFlightGather
from .flat import leaf_views
from .layout import Layout

__all__ = ["Arriving", "Arrival", "arriving"]


class Arrival:
    """Bucket ``bucket`` of an in-flight gather (``None``: every bucket); ``wait()`` waits once."""

    __slots__ = ("gather", "bucket", "done")

    def __init__(self, gather: InFlightGather, bucket: int | None):
        self.gather, self.bucket, self.done = gather, bucket, False

    def wait(self) -> None:
        if not self.done:
            if self.bucket is None:
                self.gather.wait_all()
            else:
                self.gather.wait(self.bucket)
            self.done = True


_T = torch.Tensor
# Calls that neither read nor write a leaf's memory: views of it (which wait later, as the leaf
# would), its metadata, and what autograd setup does to a leaf. Anything else waits.
_LAZY = frozenset({
    _T.view, _T.view_as, _T.reshape, _T.reshape_as, _T.__getitem__, _T.narrow, _T.split, _T.split_with_sizes,
    _T.chunk, _T.unbind, _T.t, _T.transpose, _T.permute, _T.unsqueeze, _T.squeeze, _T.flatten, _T.unflatten,
    _T.expand, _T.expand_as, _T.as_strided, _T.detach, _T.requires_grad_, _T.retain_grad, _T.register_hook,
    _T.register_post_accumulate_grad_hook, _T.size, _T.dim, _T.numel, _T.stride, _T.storage_offset,
    _T.element_size, _T.is_contiguous, _T.is_floating_point, _T.is_complex, _T.get_device, _T.__len__,
    _T.__hash__, torch.split, torch.reshape, torch.flatten, torch.t, torch.transpose, torch.narrow, torch.unbind,
    torch.chunk, torch.squeeze, torch.unsqueeze, torch.permute,
})
# Attributes that are other tensors, not views of the leaf: handed out as they are (``_base``, the
# flat buffer, is the object ``fzero.lineage`` marks)
_OTHERS = frozenset({_T._base.__get__, _T.grad.__get__})


class Arriving(torch.Tensor):
    """A params leaf (or the flat buffer) whose bucket of an in-flight all-gather it waits for
    before any call that touches its memory (module doc). ``_arrival``: its :class:`Arrival`."""

    _arrival: Arrival

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pending = [x._arrival for x in optree.tree_leaves((args, kwargs)) if isinstance(x, Arriving)
                   and not x._arrival.done]
        if pending and not (func in _LAZY or getattr(func, "__name__", None) in ("__get__", "__set__")):
            for arrival in pending:
                arrival.wait()
            pending = []
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not pending or func in _OTHERS:
            return out
        # a view of a leaf still in flight waits for the same bucket (a call that returns the
        # leaf itself, as requires_grad_ does, returns it as it is: a new alias would not be an
        # autograd leaf)
        return optree.tree_map(lambda y: _arriving(y, pending[0]) if isinstance(y, torch.Tensor)
                               and not isinstance(y, Arriving) else y, out)

    def __reduce_ex__(self, protocol):
        # saved (torch.save, pickle) as the plain tensor it is once arrived: its Work cannot be saved
        self._arrival.wait()
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        self._arrival.wait()
        plain = self.as_subclass(torch.Tensor)
        # deepcopy's memo is keyed by id: the alias must outlive the copy, or a later one may
        # take its id (and its entry); copy.deepcopy keeps such objects in memo[id(memo)]
        memo.setdefault(id(memo), []).append(plain)
        return plain.__deepcopy__(memo)


def _arriving(x: torch.Tensor, arrival: Arrival) -> Arriving:
    # as_subclass of a view keeps its ``_base``: the flat buffer, which ``fzero.lineage`` marks
    y = x.as_subclass(Arriving)
    y._arrival = arrival
    return y


def arriving(out: torch.Tensor, gather: InFlightGather, layout: Layout, *, flat: bool, like: Any = None) -> Any:
    """The params in ``out`` (``[padded_numel]``, its gather ``gather`` in flight) as the step
    returns them: ``flat``, the buffer itself, waiting for every bucket; else the pytree of
    ``like``'s structure whose leaves wait each for its own bucket."""
    if flat:
        return _arriving(out, Arrival(gather, None))
    arrivals = [Arrival(gather, i) for i in range(len(layout.buckets))]
    bucket_of = {leaf: i for i, b in enumerate(layout.buckets) for leaf in b.leaves}
    leaves = [_arriving(x, arrivals[bucket_of[k]]) for k, x in enumerate(leaf_views(out, layout))]
    treespec = layout.treespec if like is None else optree.tree_structure(like)
    return optree.tree_unflatten(treespec, leaves)
