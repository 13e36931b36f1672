"""Ending a process's use of torch.distributed: ``shutdown``, and the same at interpreter exit.

A reference to a ``ProcessGroup`` held past ``destroy_process_group()`` keeps the backend alive,
and with it gloo's worker and socket threads, into interpreter shutdown, where a rank then
intermittently aborted with ``terminate called without an active exception``. So the
communicators hold a group's *name*, never the object, and this module imports ``torch._dynamo``
at once: its first import (which the first functional collective would otherwise trigger) takes
references to every process group that exists at that moment. ``shutdown()`` (also run at
interpreter exit, see there) then frees the backend while the interpreter is still alive.
"""
from __future__ import annotations

import atexit
import sys
import warnings
import weakref

import torch.distributed as dist

# Imported after init_process_group, the import of torch._dynamo below takes references to the
# groups that exist (see above): shutdown's warning then names the import order as the cause.
_IMPORTED_AFTER_GROUP = "torch._dynamo" not in sys.modules and dist.is_available() and dist.is_initialized()
import torch._dynamo  # noqa: E402,F401 -- before any process group exists: see the module docstring

from . import arrival  # noqa: E402

__all__ = ["shutdown", "shutdown_at_exit", "before_shutdown", "ending_on_exception"]

_exit_hook_registered = False
_before: list = []  # what shutdown first waits for: work in flight that still needs the group (before_shutdown)


def before_shutdown(fn) -> None:
    """Have ``shutdown`` call ``fn()`` first, before it waits for the other ranks: a layer above
    the communicators (the checkpoint writer) ends its work in flight there. Registered once per
    process, at import."""
    _before.append(fn)


def ending_on_exception() -> bool:
    """At interpreter exit: whether an uncaught exception is ending the script (the interpreter
    keeps it in ``sys.last_exc``, ``sys.last_value`` before Python 3.12)."""
    return (getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)) is not None


def shutdown_at_exit() -> None:
    """Run ``shutdown(barrier=False)`` at interpreter exit (once per process): a script that
    ends without ``destroy_process_group`` still frees the backend before finalization. Every
    communicator of a process group registers it when it is made."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(shutdown, barrier=False, at_exit=True)


def shutdown(*, barrier: bool = True, at_exit: bool = False, timeout: float = 60.0) -> None:
    """End this process's use of torch.distributed: wait for every rank (``barrier``, at most
    ``timeout`` seconds for the last one to arrive, see ``fzero.comm.arrival``), then
    ``destroy_process_group()`` and check that the backend is really gone.

    Called while an exception propagates (``try: main() finally: fzero.shutdown()``), it waits
    for nobody and destroys nothing: it tells the ranks waiting in an fzero call that this rank
    failed (they raise at once, naming its error) and returns, so the exception is shown and the
    process exits, which ends its peers' collectives too (a collective of this rank may still be
    in flight: destroying the group would wait for it).

    First it waits for the work in flight registered with :func:`before_shutdown` -- every
    checkpoint ``async_save`` still writing, whose failure it reports -- also with no process group.

    Call it on every rank at the end of a torchrun script (with no process group initialized it
    only does the above). Destroying the group joins the backend's threads (gloo's workers
    and socket loop) while the interpreter is still alive; a backend that outlives it runs
    those threads through interpreter shutdown, where a rank could abort with ``terminate
    called without an active exception``. The barrier keeps a rank from tearing its
    connections down while a peer still uses them. fzero registers ``shutdown(barrier=False)``
    to run at interpreter exit, so a script that ends without it is safe as well -- unless it
    still holds a ``ProcessGroup`` object of its own then, which keeps the backend alive: a
    ``RuntimeWarning`` says so. The exit hook does nothing after an uncaught exception (a
    collective may still be in flight; destroying the group would wait for it)."""
    if at_exit and ending_on_exception():
        return  # an uncaught exception ends the script: a collective may still be in flight, don't wait on it
    initialized = dist.is_available() and dist.is_initialized()
    failing = sys.exc_info()[1]
    if failing is not None and not at_exit:
        if initialized:
            arrival.report_failure(failing)
        return
    for fn in _before:
        fn()
    if not initialized:
        return
    group = dist.group.WORLD
    if barrier:
        if dist.get_world_size() > 1:
            arrival.arrive(group.group_name, "fzero.shutdown", timeout=timeout)
        dist.barrier()
    alive = weakref.ref(group)
    del group
    arrival.reset()
    dist.destroy_process_group()
    if alive() is not None:
        cause = ("fzero was imported after init_process_group, and its import of torch._dynamo took references to "
                 "the process groups alive then: import fzero before init_process_group" if _IMPORTED_AFTER_GROUP else
                 "drop your references to ProcessGroup objects before exit")
        warnings.warn(
            "fzero.shutdown: the default process group is still referenced after destroy_process_group(), "
            f"so its backend threads outlive it; {cause}",
            RuntimeWarning,
            stacklevel=3 if at_exit else 2,
        )
