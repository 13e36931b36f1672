"""Saves written in the background: one writer per engine, one save in flight, in call order.

``async_save`` stages the rank's part of the snapshot in the caller (:mod:`.staging`), then hands
the write and the commit to a thread and returns a :class:`SaveFuture`. Why a thread, not a
process: the thread spends its time in ``os.write``, ``fsync`` and ``hashlib`` on large buffers,
all of which release the GIL (:mod:`.shard_file`), so the training loop keeps the GIL; a writer
process would need the staging buffer in shared memory and a process per rank for the same
system calls (``benchmarks/checkpoint.py`` measures both: docs/checkpoints.md).

An engine's saves run one at a time: a save (``save`` or ``async_save``) first waits for the
one in flight, so snapshots commit in call order and one staging buffer serves every save. The
writer thread (one per engine, started at its first ``async_save``, ended with it) is a daemon:
what waits for a save in flight is fzero, explicitly -- ``fzero.shutdown()``, and at interpreter
exit an ``atexit`` hook. A normal exit waits for the save to end. An exit through an uncaught
exception waits at most the engine's ``call_timeout``, then warns that the save was not waited
for (the checkpoint keeps its previous snapshot): the exception may be a peer's death, and a
writer waiting for that peer's part of the save would otherwise hold the process until the
store's timeout (30 minutes by default). Either way the hook then ends the thread and joins it
(at most ``call_timeout`` more), stopping the save's wait for the other ranks at once
(``StoreExchange``'s ``stop``): a daemon thread still alive when the interpreter finalizes is
ended by ``pthread_exit`` as it next takes the GIL, and inside torch's store calls, which release
the GIL in a C++ guard, that unwinding aborts the process (``terminate called without an active
exception``, pytorch/pytorch#38228). A save that failed and whose future nobody asked
(``result()``, ``exception()``) is reported when the next save of the engine starts or at
shutdown or exit, with a ``RuntimeWarning`` naming the path and the error, so a failure is never
lost silently.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import queue
import sys
import threading
import warnings
import weakref
from concurrent.futures import Future
from typing import Callable

from ..comm import teardown
from ..comm.store_exchange import StoreExchange, own_connection
from .staging import StagingBuffer

__all__ = ["SaveFuture", "Writer", "writer_of", "wait_for", "wait_all"]


class SaveFuture(Future):
    """The future of one ``async_save``: ``result()`` is ``None`` once the snapshot is committed,
    or raises its ``CheckpointError`` (the same on every rank). ``path``: the checkpoint;
    ``exit_timeout``: how long an exit through an uncaught exception waits for it (the engine's
    ``call_timeout``, module doc)."""

    def __init__(self, path: str, exit_timeout: float):
        super().__init__()
        self.path, self.exit_timeout, self._asked = path, exit_timeout, False

    def result(self, timeout=None):
        self._asked = True
        return super().result(timeout)

    def exception(self, timeout=None):
        self._asked = True
        return super().exception(timeout)

    def report(self, timeout: float | None = None) -> None:
        """Wait for it (``concurrent.futures.TimeoutError`` after ``timeout`` seconds); if it
        failed and nobody asked, warn, naming the path and the error."""
        error = super().exception(timeout)
        if error is not None and not self._asked:
            self._asked = True
            warnings.warn(f"fzero.checkpoint.async_save to {self.path} failed, and its future was never asked: {error}",
                          RuntimeWarning, stacklevel=3)


class Writer:
    """An engine's background saves: the staging buffer, the writer thread, the save in flight,
    the store connection its exchanges use (module doc)."""

    def __init__(self):
        self.buffer = StagingBuffer()
        self.pending: SaveFuture | None = None
        self.jobs: queue.SimpleQueue | None = None  # the writer thread's work; None ends it
        self.thread: threading.Thread | None = None
        self.nice: int | None = None  # the thread's nice value
        self.store = None  # its own connection to the store, made at the first exchange with other ranks
        self.stopping = threading.Event()  # set at exit: the exchange in flight stops waiting (end)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the engine's save in flight, if any, has ended (reported: :meth:`SaveFuture.report`),
        or ``timeout`` seconds have passed; whether it ended."""
        if self.pending is None:
            return True
        try:
            self.pending.report(timeout)
        except concurrent.futures.TimeoutError:
            return False
        self.pending = None
        return True

    def exchange(self, comm, *, first_timeout: float) -> StoreExchange:
        """The exchange of the engine's next background save with the other ranks' writers: its key
        is the count of background saves made on ``comm``'s ranks, the same on every rank with no
        communication (each rank makes the same calls in the same order); ``first_timeout``: how
        long the first round waits for the other ranks to make the call."""
        group = comm.data_parallel_name
        n = _calls[group] = _calls.get(group, 0) + 1
        if self.store is None and comm.data_parallel > 1:
            self.store = own_connection()
        return StoreExchange.of(comm, self.store, f"save/{group}/{n}", first_timeout=first_timeout,
                                stop=self.stopping)

    def submit(self, path: str, write: Callable[[], None], *, nice: int, timeout: float) -> SaveFuture:
        """Run ``write`` in the writer thread, at CPU priority ``nice`` (:func:`lower_priority`);
        its future. ``timeout``: the engine's ``call_timeout`` (module doc). Call :meth:`wait` first."""
        if self.nice != nice:  # a thread's nice only goes up (without privileges): a new thread
            if self.jobs is not None:
                self.jobs.put(None)
            self.jobs, self.nice = queue.SimpleQueue(), nice
            self.thread = threading.Thread(target=_serve, args=(self.jobs, nice), name="fzero-checkpoint-writer",
                                           daemon=True)
            self.thread.start()
            weakref.finalize(self, self.jobs.put, None)  # the thread ends with its writer (its engine)
        future = self.pending = SaveFuture(path, timeout)
        future.set_running_or_notify_cancel()
        self.jobs.put((future, write))
        return future

    def end(self, *, stop: bool, timeout: float | None) -> None:
        """At interpreter exit: end the writer thread once its save in flight is done -- with
        ``stop``, at once if that save is waiting for another rank (it fails; the checkpoint keeps
        its previous snapshot) -- and join it, at most ``timeout`` seconds."""
        if stop:
            self.stopping.set()
        if self.jobs is not None:
            self.jobs.put(None)
            self.jobs = self.nice = None
        if self.thread is not None:
            self.thread.join(timeout)


def _serve(jobs: queue.SimpleQueue, nice: int) -> None:
    """The writer thread: each ``(future, write)`` of ``jobs`` in turn, until ``None``. Holds no
    reference to its ``Writer``, so the writer (and its buffer) go with the engine."""
    lower_priority(nice)
    while (job := jobs.get()) is not None:
        future, write = job
        try:
            write()
        except BaseException as e:  # noqa: BLE001 -- delivered through the future
            future.set_exception(e)
        else:
            future.set_result(None)
        del job, future, write  # nothing of the save stays alive while the thread waits for the next


def lower_priority(nice: int) -> None:
    """Set the calling thread's nice value to ``nice`` (Linux: each thread has its own; elsewhere,
    where only a process has one, nothing changes)."""
    if nice and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


_writers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine -> its Writer (off the hot path)
_calls: dict[str, int] = {}  # data-parallel group -> background saves made on it (as arrival counts calls)


def writer_of(engine) -> Writer:
    """The engine's writer, made at its first background save."""
    writer = _writers.get(engine)
    if writer is None:
        writer = _writers[engine] = Writer()
    return writer


def wait_for(engine) -> None:
    """Wait for the engine's save in flight, if any (a save waits for it: call order)."""
    writer = _writers.get(engine)
    if writer is not None:
        writer.wait()


def wait_all() -> None:
    """Wait for every engine's save in flight, reporting unasked failures (``fzero.shutdown``)."""
    for writer in list(_writers.values()):
        writer.wait()


def _before_shutdown() -> None:
    """``fzero.shutdown``: wait for the saves in flight; the groups (and their store) end next,
    so the counts start again from zero, on every rank alike."""
    wait_all()
    _calls.clear()
    for writer in list(_writers.values()):
        writer.store = None


def _at_exit() -> None:
    """Interpreter exit (module doc): wait for the saves in flight, at most ``call_timeout``
    each when an uncaught exception ends the script, then end the writer threads."""
    failing = teardown.ending_on_exception()
    for writer in list(_writers.values()):
        pending = writer.pending
        timeout = pending.exit_timeout if pending is not None and failing else None
        done = writer.wait(timeout)
        if not done:
            warnings.warn(f"fzero.checkpoint.async_save to {pending.path} was still writing when the script ended "
                          f"with an exception; not waited for beyond {pending.exit_timeout:g} s: the checkpoint keeps "
                          "its previous snapshot", RuntimeWarning, stacklevel=1)
        writer.end(stop=not done, timeout=timeout)


teardown.before_shutdown(_before_shutdown)
atexit.register(_at_exit)  # registered first, so it runs after fzero.shutdown's own exit hook
