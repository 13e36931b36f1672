"""The params' door: the form a call's params take, built once per call.

``Engine.step`` and ``Engine.with_fp32_master`` take the params as ``init``/``step`` returned them:
a pytree of ``param_dtype`` views of one flat ``[N*S]`` buffer, or that buffer itself
(``engine.flat_params``). The grads' door checks them against the layout (``GradPath.check``,
which returns a pytree's leaves), and ``ParamsForm.of`` keeps what every later reader needs -- the checked leaves, whether they
came flat, and the flat buffer where it can be read -- so that the plan (``fzero.plan``), the
stages, the lineage checks (``fzero.lineage``) and the master's storage (``fzero.storage``) read it
instead of walking the tree and looking the buffer up again.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .flat import flatten, shard_of
from .layout import Layout
from .memory import viewed_buffer

__all__ = ["ParamsForm"]


class ParamsForm(NamedTuple):
    """``given``: the params as passed; ``flat_in``: they are the flat ``[N*S]`` buffer;
    ``leaves``: a pytree's leaves in the layout's order (``None`` when flat); ``buffer``: the flat
    ``[N*S]`` buffer they are (views of) -- the given tensor when flat; for a pytree, looked up
    eagerly (``fzero.memory.viewed_buffer``), ``None`` where the leaves are not views of one such
    buffer or the call is traced (a traced tensor has no storage to read)."""

    given: Any
    flat_in: bool
    leaves: list[torch.Tensor] | None
    buffer: torch.Tensor | None

    @classmethod
    def of(cls, params: Any, leaves: list[torch.Tensor] | None, layout: Layout, *, traced: bool) -> "ParamsForm":
        """The form of ``params``, whose leaves ``GradPath.check`` returned (``None``: flat), laid
        out as ``layout``; ``traced``: the call is traced by ``torch.compile`` (no buffer lookup)."""
        if leaves is None:
            return cls(params, True, None, params)
        buffer = None if traced else viewed_buffer(leaves, layout.offsets, layout.padded_numel)
        return cls(params, False, leaves, buffer)

    def shard(self, layout: Layout, rank: int) -> torch.Tensor:
        """This rank's ``[S]`` shard of the params' flat buffer: a view of their own buffer where
        there is one, else laid out anew from the leaves."""
        flat = flatten(self.leaves, layout) if self.buffer is None else self.buffer
        return shard_of(flat, layout, rank)
