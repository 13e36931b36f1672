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
tensor objects over the same memory (``hand_over``); the given master is marked consumed (so is
the state given to ``load_params``, whose moments the new state goes on with), and every reader
of a state -- a second step, ``load_params``, the checkpoint functions, ``get_hyperparams``,
``nonfinite_leaves`` -- refuses it (``refuse_consumed``; JAX raises for a donated buffer too)
instead of counting once more or reading the later step's values as its own.

What version counters miss: a write through ``.data`` (a tensor with a counter of its own), a
NumPy view, an edit of cloned params passed back in. ``checked_fp32_master`` finds those by
value, off the hot path, where the params are read with the state anyway (``full_master``,
``export_full``): the params must be the master cast to ``param_dtype``, exactly, after every
step and every skipped one. That relation
holds with the FP32 master; with ``master="remainder"`` the FP32 master is rebuilt from the
params, so it holds whatever they are (an edit is caught only where it makes the master NaN: a
zeroed leaf); with ``master="params"`` the params are the master, and a write into them is a
write into the master.

Marks are plain Python attributes (``Tensor.__dict__``): ``copy.deepcopy`` keeps them, ``clone``
drops them. Under ``torch.compile`` nothing is marked or checked (dynamo cannot read version
counters); the supported way to change weights after ``init`` is ``Engine.load_params``.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, NamedTuple

import optree
import torch

from fzero.transforms.hyperparams import register_holder

from .binding import ZeroState
from .cast import cast_params
from .flat import leaf_views
from .memory import marked_buffer
from .params_form import ParamsForm
from .plan import tracing
from .shard_view import leaf_runs

__all__ = ["Mark", "ParamsEditedError", "mark", "params_of", "check", "refuse_consumed", "consume",
           "hand_over", "checked_fp32_master"]

_ATTR = "_fzero_mark"
_TICKET = "_fzero_ticket"
# id(master) -> weak references to that master and to the flat params buffer last marked with it.
# Beside the tensors, not on them: an attribute on the master would travel with every torch.save
# of a state, and torch.load(weights_only=True) refuses what it does not know. Keyed by id (a
# tensor's == is elementwise, so tensors cannot be dict keys); an entry leaves with its master.
# Weak both ways: nothing here keeps a master or a params buffer alive.
_PARAMS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_CONSUMED = "_fzero_consumed"
_tickets = itertools.count(1)  # only compared for equality: any unique int would do


class ParamsEditedError(RuntimeError):
    """The params were written in place since the engine last wrote them."""


class Mark(NamedTuple):
    ticket: int
    buffer_version: int
    master_version: int


def mark(params: Any, master: torch.Tensor) -> None:
    """Record that ``params`` were written together with the state whose master is ``master``."""
    if tracing():  # before the leaves: traced, each optree call is thousands of instructions
        return
    buf = marked_buffer(params)
    if buf is None:
        return
    ticket = next(_tickets)
    setattr(buf, _ATTR, Mark(ticket, buf._version, master._version))
    setattr(master, _TICKET, ticket)
    key = id(master)
    if key not in _PARAMS or _PARAMS[key][0]() is not master:
        _PARAMS[key] = (weakref.ref(master, lambda _, key=key: _PARAMS.pop(key, None)), weakref.ref(buf))
    else:
        _PARAMS[key] = (_PARAMS[key][0], weakref.ref(buf))


def params_of(master: torch.Tensor) -> torch.Tensor | None:
    """The flat params buffer last marked with ``master``'s state (``[N*S]``, ``param_dtype``)
    if it is still alive and was not marked with another state since; else ``None``."""
    refs = _PARAMS.get(id(master))
    buf = refs[1]() if refs is not None and refs[0]() is master else None
    m: Mark | None = getattr(buf, _ATTR, None)
    return buf if m is not None and m.ticket == getattr(master, _TICKET, None) else None


def check(params: ParamsForm, master: torch.Tensor, *, where: str, same_step: bool) -> None:
    """Raise if the params (the door's form, ``fzero.params_form``) were edited in place since
    they were marked with ``master``'s state, or, with ``same_step``, if they were marked with
    another state (see the module doc)."""
    if tracing():
        return
    refuse_consumed(master, where)
    buf = params.buffer
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


def refuse_consumed(tree: Any, where: str) -> None:
    """Raise (naming ``where``) if ``tree`` -- a ``ZeroState``, its master, or any pytree holding
    one -- holds a state that a donating step consumed: its memory holds that step's results."""
    if tracing():
        return
    leaves = (tree,) if isinstance(tree, torch.Tensor) else optree.tree_leaves(tree)
    if any(getattr(x, _CONSUMED, False) for x in leaves):
        raise ValueError(
            f"{where}: this state was donated to an earlier step (donate=True), which wrote its result into the same "
            "memory: it holds that step's values now, not its own. Pass the state that step returned (stepping this "
            "one again would apply another update, not repeat the first); to keep a state past the next step (the "
            "best so far, to export later), copy it before that step: kept = copy.deepcopy((params, state))")


def consume(state: ZeroState) -> None:
    """Mark ``state`` consumed: its memory goes on in another state (a donating step's)."""
    if not tracing():
        setattr(state.master, _CONSUMED, True)


def hand_over(state):
    """A donated ``state`` (a NamedTuple with a ``master``), now holding the step's results, as
    the step's output: the same memory, a new master object; the given one is marked consumed."""
    if tracing():
        return state
    consume(state)
    return state._replace(master=state.master.view_as(state.master))


def _transform_state(state: ZeroState, where: str) -> Any:
    """``state.tx_state`` for ``transforms.get_hyperparams`` and friends, refused if consumed."""
    refuse_consumed(state, where)
    return state.tx_state


register_holder(ZeroState, _transform_state)


_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}  # a dtype's bits as ints


def checked_fp32_master(params: Any, state: ZeroState, engine, *, where: str) -> ZeroState:
    """``engine.with_fp32_master(params, state, where=where)`` (``state`` with its FP32 ``[S]``
    master), after checking the values: this rank's shard of ``params`` (the pytree or the flat
    ``[N*S]`` buffer) must be that master cast to ``param_dtype``, bit for bit (NaN where it is
    NaN), as every ``init``, ``step`` (skipped or not), ``load_params`` and load leave them. A
    write no version counter saw (through ``.data``, a NumPy view, cloned params edited and
    passed back) raises ``ParamsEditedError`` naming ``where``, each leaf and how many of its
    elements differ. One pass over the ``[S]`` shard comparing bits, a host sync per leaf: for
    checkpoint save and export, not for every step."""
    full = engine.with_fp32_master(params, state, where=where)
    master, layout, rank = full.master, engine.layout, engine.comm.rank
    leaves = engine.grad_path.check(params, "params")
    leaves = [x.reshape(-1) for x in (leaf_views(params, layout) if leaves is None else leaves)]
    want = cast_params(master, engine.param_dtype).to(engine.device)  # one copy where the state is offloaded
    differ: dict[int, torch.Tensor] = {}  # leaf -> how many of its elements differ (a leaf is in one run)
    bits = _BITS[want.dtype]
    for run in leaf_runs(layout, rank):
        got = leaves[run.leaf][run.start : run.start + run.length]
        cast = want[run.shard_at : run.shard_at + run.length]
        # the same bits (the case of every save, at memory speed); else count, NaN equal to NaN
        if not torch.equal(got.view(bits), cast.view(bits)):
            differ[run.leaf] = ((got != cast) & ~(got.isnan() & cast.isnan())).sum()
    counts = torch.stack(list(differ.values())).tolist() if differ else []
    edited = [f"{layout.paths[i]!r} ({n} of {layout.shapes[i].numel()} elements)" for i, n in zip(differ, counts) if n]
    if edited:
        raise ParamsEditedError(
            f"{where}: the params differ from the master weights cast to {engine.param_dtype} (rank {rank}'s shard) "
            f"in {', '.join(edited)}: they were written where no version counter saw it (through .data, a NumPy view, "
            "cloned params edited and passed back in, a forward that writes weight.data). The master is the truth: "
            "the next step would undo the write, and a save or export would store the master without it. To set "
            "weights use `params, state = engine.load_params(state, values)` (values: the whole pytree, FP32 for "
            "full precision; the optimizer state kept); to keep the master, pass the params the last step returned.")
    return full
