"""Which state the engine wrote a params buffer with: params edited behind the engine's back,
and params paired with another step's state, are caught before they train wrong.

The params are ``param_dtype`` views of one flat buffer, and the truth is the master in the
state: every step writes the params from it. Two ordinary mistakes would otherwise go unseen:

* **an in-place write into the params** between steps (weights copied in after ``init``,
  ``zero_()`` on a leaf): the next step would undo it with the FP32 master, or, with
  ``master="remainder"``, join the written bits with the old remainder (a zeroed leaf turns NaN);
* **params from another step** (say ``init``'s, with the state after five steps): with the
  remainder master the FP32 master *is* params + remainder, so it would be silently wrong.

Every eager ``init``, ``step``, ``load_params`` and checkpoint load marks what it returns: the
flat params buffer gets a ``Mark`` (a ticket and both tensors' version counters), the state's
master the same ticket. Every in-place write bumps a tensor's version counter (views share their
base's), so ``check`` can tell, with no device work and no sync:

* buffer written, master not: the params were edited -> ``ParamsEditedError``;
* the two tickets differ: the params were written with another state -> ``ValueError``
  (checked where the params are read: the remainder master, the params as master);
* both written (a compiled step with ``donate`` wrote them in place), or either unmarked
  (a compiled step's new tensors, a clone): nothing is known, nothing is raised.

With ``donate=True`` the step writes the new state into the given one and hands it back as new
tensor objects over the same memory (``hand_over``); the given master is marked consumed, and a
second step with it raises (JAX raises for a donated buffer too) instead of counting once more.

Marks are plain Python attributes (``Tensor.__dict__``): ``copy.deepcopy`` keeps them, ``clone``
drops them. Under ``torch.compile`` nothing is marked or checked (dynamo cannot read version
counters); the supported way to change weights after ``init`` is ``Engine.load_params``.
"""
from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import optree
import torch

from .mode import compiling

__all__ = ["Mark", "ParamsEditedError", "buffer_of", "mark", "check", "hand_over"]

_ATTR = "_fzero_mark"
_TICKET = "_fzero_ticket"
_CONSUMED = "_fzero_consumed"
_tickets = itertools.count(1)  # only compared for equality: any unique int would do


class ParamsEditedError(RuntimeError):
    """The params were written in place since the engine last wrote them."""


class Mark(NamedTuple):
    ticket: int
    buffer_version: int
    master_version: int


def buffer_of(params: Any) -> torch.Tensor | None:
    """The flat buffer ``params`` are (the ``[N*S]`` tensor itself) or whose views they are (the
    first leaf's base), without walking the leaves; ``None`` if there is none."""
    if isinstance(params, torch.Tensor):
        return params
    leaves = optree.tree_leaves(params)
    return leaves[0]._base if leaves and isinstance(leaves[0], torch.Tensor) else None


def mark(params: Any, master: torch.Tensor) -> None:
    """Record that ``params`` were written together with the state whose master is ``master``."""
    if compiling():  # before the leaves: traced, each optree call is thousands of instructions
        return
    buf = buffer_of(params)
    if buf is None:
        return
    ticket = next(_tickets)
    setattr(buf, _ATTR, Mark(ticket, buf._version, master._version))
    setattr(master, _TICKET, ticket)


def check(params: Any, master: torch.Tensor, *, where: str, same_step: bool) -> None:
    """Raise if ``params`` were edited in place since they were marked with ``master``'s state,
    or, with ``same_step``, if they were marked with another state (see the module doc)."""
    if compiling():
        return
    if getattr(master, _CONSUMED, False):
        raise ValueError(f"{where}: this state was donated to an earlier step (donate=True), which wrote its result "
                         "into the same memory: pass the state that step returned (using it twice would apply "
                         "another update, not repeat the first)")
    buf = buffer_of(params)
    if buf is None:
        return
    m: Mark | None = getattr(buf, _ATTR, None)
    ticket = getattr(master, _TICKET, None)
    if m is None or ticket is None:
        return
    if m.ticket != ticket:
        if same_step:
            raise ValueError(
                f"{where}: these params were not written together with this state (they come from another "
                "init/step/load, e.g. init's params with a later step's state): with master='remainder' the FP32 "
                "master is rebuilt from the params, with master='params' it is the params, so it would be wrong. "
                "Pass the params and state that the same call returned.")
        return
    if buf._version != m.buffer_version and master._version == m.master_version:
        raise ParamsEditedError(
            f"{where}: the params were written in place since the engine returned them (copy_, zero_, "
            "load_state_dict into the views, ...), but the optimizer state was not: the master weights are the "
            "truth, so the write would be silently undone (or, with master='remainder', mixed into the master). "
            "To set weights after init use `params, state = engine.load_params(state, new_params)` (optimizer "
            "state kept), or `engine.init(new_params)` for a fresh optimizer state.")


def hand_over(state):
    """A donated ``state`` (a NamedTuple with a ``master``), now holding the step's results, as
    the step's output: the same memory, a new master object; the given one is marked consumed."""
    if compiling():
        return state
    setattr(state.master, _CONSUMED, True)
    return state._replace(master=state.master.view_as(state.master))
