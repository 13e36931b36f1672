"""How a checkpoint call runs on the engine's group: every rank takes part in every phase.

**Errors are agreed.** Every phase that may fail on some ranks (filesystem errors, a missing,
truncated or corrupted shard, a checkpoint of another model) ends with one small
``all_gather_object`` of each rank's error (or ``None``); if any rank failed, *every* rank
raises the same :class:`CheckpointError`, naming the rank(s), the file and, for a model or
state mismatch, the leaf. No rank is left waiting in a collective for a rank that gave up.
A rank that dies outright ends the others' wait through the process group (gloo reports the
closed connection at once; NCCL through its timeout/watchdog).

``async_save``'s writer thread agrees the same way through a
:class:`fzero.comm.store_exchange.StoreExchange` in place of the communicator (``agree`` needs
only ``data_parallel``, ``rank`` and ``all_gather_object``), never through the process group.
"""
from __future__ import annotations

from typing import Any, Callable

from ..engine import Engine
from .strict_json import CheckpointError

__all__ = ["ready", "agree", "error_text"]


def error_text(e: Exception) -> str:
    """How a rank's error reads in an agreed ``CheckpointError``: its message, after its type
    unless it is a ``CheckpointError``."""
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def agree(comm, what: str, fn: Callable[[], Any], *, gather: bool = False):
    """Run ``fn`` on every rank, then one ``all_gather_object`` of each rank's error (and, with
    ``gather``, its small picklable result). If any rank failed, every rank raises the same
    :class:`CheckpointError` naming the failing ranks. Returns this rank's result, or with
    ``gather`` the list of every rank's. ``what`` names the phase in errors."""
    try:
        result, err, exc = fn(), None, None
    except Exception as e:  # noqa: BLE001 -- reported to every rank, then raised
        result, err, exc = None, error_text(e), e
    if comm.data_parallel == 1:
        if exc is not None:
            if isinstance(exc, CheckpointError):
                raise exc
            raise CheckpointError(f"{what}: {err}") from exc
        return [result] if gather else result
    try:
        gathered = comm.all_gather_object((err, result if gather else None))
    except Exception as e:  # noqa: BLE001 -- a dead rank, a timeout: the group itself failed
        raise CheckpointError(
            f"{what}: rank {comm.rank} could not agree with the other ranks (did one die?): {type(e).__name__}: {e}"
        ) from (exc or e)
    failed: dict[str, list[int]] = {}
    for rank, (e, _) in enumerate(gathered):
        if e is not None:
            failed.setdefault(e, []).append(rank)
    if failed:
        msg = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {e}" for e, r in failed.items())
        raise CheckpointError(f"{what}: {msg}") from exc
    return [r for _, r in gathered] if gather else result


def ready(engine: Engine, where: str):
    """``(layout, comm)`` of an engine a checkpoint call (``where``, its signature) can use: an
    ``Engine`` (``TypeError`` naming what came instead: arguments given out of order), ``init``-ed,
    not simulated, its group unchanged since ``init``; ``RuntimeError`` otherwise."""
    if not isinstance(engine, Engine):
        raise TypeError(f"fzero.checkpoint.{where}: the engine argument is a {type(engine).__name__}, not the Engine "
                        "that fzero.zero1 built: check the order of the arguments")
    if engine.layout is None:
        raise RuntimeError("fzero.checkpoint needs an engine after engine.init (it supplies the layout)")
    comm = engine.comm
    if getattr(comm, "simulated", False):
        raise RuntimeError("cannot checkpoint a simulated engine (zero1(simulate=...))")
    comm.check_unchanged()
    return engine.layout, comm
