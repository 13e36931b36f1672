"""Small values gathered from every rank through the store, off every process group.

A background thread that must agree with its peers (``fzero.checkpoint.async_save``'s writer)
cannot use the training loop's process group: its collectives would interleave with the loop's
own, in a different order on different ranks -- the deadlock reported of threaded
``torch.distributed.checkpoint.async_save``, whose upload runs ``save`` on the caller's group.
Nor can it share the store's client with the main thread: a TCPStore client holds its lock
through a blocking ``wait`` (``TCPStore::wait`` in c10d), so a main thread waiting in an
arrival (``fzero.comm.arrival``) would hold the writer's exchange until that arrival completes,
which may need the writer's save to end first. So an exchange talks to the store through a
connection of its own (:func:`own_connection`: ``Store.clone()``; older torch shares the
client) and waits by polling ``check``, never holding the client in a wait, with a deadline and
a ``stop`` event its owner may set to end the wait at once (a thread that must end before the
interpreter does: ``fzero.checkpoint.background``).

Keys: ``fzero/exchange/<key>/<round>/<index>``: ``key`` names the exchange and must be the same
on every rank without communication (``fzero.checkpoint.background`` counts the calls made on a
group, as ``fzero.comm.arrival`` does); ``round`` counts its rounds; ``index`` is the rank's place
among the participants. Values are JSON. A round deletes this rank's key of the round before
(every rank has read it once any rank has finished this one); the last round's key stays.
"""
from __future__ import annotations

import json
import threading
import time

import torch.distributed as dist

__all__ = ["StoreExchange", "ExchangeStopped", "own_connection"]

_DEFAULT_TIMEOUT = 1800.0  # seconds: torch's default process-group timeout, for a store that does not say


def own_connection():
    """A client of the default group's store with its own connection, where the store can make
    one (``Store.clone``, torch >= 2.6), else the shared client (module doc)."""
    store = dist.distributed_c10d._get_default_store()
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):  # older torch; a store without clone
        return store


class ExchangeStopped(RuntimeError):
    """A round that its ``stop`` event ended before every participant posted."""


class StoreExchange:
    """Every participant's JSON value, in rounds, through ``store`` (module doc).

    ``index``: this rank's place among the ``size`` participants (the order of the gathered
    list); ``timeout``: seconds a round waits for the others (default: the store's, the process
    group's), ``first_timeout`` the first round's (the others' arrival: a rank that never makes
    the call); ``stop``: an event that, once set, makes a round raise :class:`ExchangeStopped`
    at once instead of waiting on. ``rank``/``world_size``/``replica``/``replicas``/``data_parallel``: as the
    communicator it stands in for (:meth:`of`) where only small values must be agreed
    (``fzero.checkpoint.collective.agree``)."""

    def __init__(self, store, key: str, index: int, size: int, *, timeout: float | None = None,
                 first_timeout: float | None = None, stop: threading.Event | None = None, rank: int = 0, world_size: int = 1, replica: int = 0,
                 replicas: int = 1):
        self.store, self.base, self.index, self.size, self.round = store, f"fzero/exchange/{key}", index, size, 0
        if timeout is None:
            timeout = store.timeout.total_seconds() if store is not None and hasattr(store, "timeout") else _DEFAULT_TIMEOUT
        self.timeout, self.first_timeout = timeout, timeout if first_timeout is None else first_timeout
        self.stop = threading.Event() if stop is None else stop
        self.rank, self.world_size, self.replica, self.replicas = rank, world_size, replica, replicas

    @classmethod
    def of(cls, comm, store, key: str, **kw) -> "StoreExchange":
        """The exchange among ``comm``'s data-parallel ranks, indexed as its ``all_gather_object``
        lists them (replica-major); ``store``: unused with one participant (may be ``None``)."""
        return cls(store, key, comm.replica * comm.world_size + comm.rank, comm.data_parallel, rank=comm.rank,
                   world_size=comm.world_size, replica=comm.replica, replicas=comm.replicas, **kw)

    @property
    def data_parallel(self) -> int:
        return self.size

    def _key(self, round: int, index: int) -> str:
        return f"{self.base}/{round}/{index}"

    def post(self, obj) -> None:
        """Give ``obj`` as this rank's value of the next round without waiting for the others
        (a rank that leaves the exchange: its peers' round ends with it)."""
        if self.size > 1:
            self.round += 1
            self.store.set(self._key(self.round, self.index), json.dumps(obj))

    def all_gather_object(self, obj) -> list:
        """Every participant's ``obj`` (JSON: tuples come back as lists), in index order.
        ``TimeoutError`` naming the participants that did not post within the timeout; a
        store that fails (its host, rank 0's process, died) raises its own error;
        :class:`ExchangeStopped` once ``stop`` is set."""
        if self.size == 1:
            return [obj]
        self.post(obj)
        keys = [self._key(self.round, i) for i in range(self.size)]
        timeout = self.first_timeout if self.round == 1 else self.timeout
        deadline, pause = time.monotonic() + timeout, 0.001
        while not self.store.check(keys):
            if self.stop.is_set():
                raise ExchangeStopped(f"{self.base}: stopped in round {self.round}, waiting for the other ranks")
            if time.monotonic() > deadline:
                missing = [i for i in range(self.size) if not self.store.check([keys[i]])]
                raise TimeoutError(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not "
                                   f"take part within {timeout:g} s")
            self.stop.wait(pause)
            pause = min(2 * pause, 0.05)
        values = [json.loads(self.store.get(k)) for k in keys]
        if self.round > 1:
            self.store.delete_key(self._key(self.round - 1, self.index))
        return values
