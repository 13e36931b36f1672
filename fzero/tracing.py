"""Whether ``torch.compile`` is tracing the caller: the one function in fzero that asks.

The step's path is chosen in ``fzero.plan``, whose ``tracing()`` calls this, once per step. The
ground floor (``fzero.flat``, ``fzero.grads``, ``fzero.checks``, ``fzero.remainder``,
``fzero.comm``) asks it only for the traceable form of the same operation -- a collective, a
``cat``, a rounding of the same bits, the same pieces in the order a trace can take -- or to
leave out a host-side check a trace cannot run (data pointers, a tree structure, a failed
collective named by rank); never to choose a path.
"""
from __future__ import annotations

import torch

__all__ = ["compiling"]


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing the caller."""
    return torch.compiler.is_compiling()
