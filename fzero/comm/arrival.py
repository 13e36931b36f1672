"""Every rank reaches the same collective fzero call, or every waiting rank says which did not.

A collective called on some ranks only (``engine.init`` or ``checkpoint.save`` under ``if rank
== 0:``, a torch habit), or a rank that raised while its peers wait, would otherwise hold the
others in a collective until the process group's timeout (30 minutes by default), silently.
So each collective fzero call that is not on the hot path (``init``, ``load_params``, the
checkpoint functions, ``shutdown``) first *arrives*: through the process group's store (the
key-value store every process group is built on: TCP or file, no collective), each rank posts
the call it is in and waits at most ``timeout`` seconds for all the others:

* all in the same call: it returns (two store round trips, one blocking wait);
* some rank in another call (or, via ``report_failure``, failed): every rank that waits raises at
  once, naming each rank's call or error;
* some rank not there after ``timeout``: the waiting ranks raise, naming the missing ranks.

Calls are matched by their order: the n-th arrival of a rank in a group meets the n-th
arrival of every other rank of that group. The hot path (``step``, ``grad_and_value``) never
arrives: a rank that is missing there ends its peers' wait by exiting (gloo reports the closed
connection at once), which is why ``shutdown`` does not wait while an exception propagates.
"""
from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from .errors import CollectiveError, ranks_text

__all__ = ["arrive", "elsewhere", "report_failure", "reset"]

_arrivals: dict[str, int] = {}  # group name -> arrivals this process made in it (off the hot path)
_PREFIX = "fzero/arrive"


def _store():
    # The default group's store: every group of this process shares it (keys are prefixed
    # with the group's name below).
    return dist.distributed_c10d._get_default_store()


def _keys(group: str, n: int):
    base = f"{_PREFIX}/{group}/{n}"
    return base, (lambda rank: f"{base}/rank{rank}")


def arrive(group: str, what: str, *, timeout: float) -> None:
    """Wait until every rank of process group ``group`` (a name) has made its matching
    arrival, in the call ``what``; ``CollectiveError`` on every waiting rank otherwise (module doc).
    Ranks are named by their global rank."""
    pg = dist.distributed_c10d._resolve_process_group(group)
    ranks, me = dist.get_process_group_ranks(pg), dist.get_rank()
    n = _arrivals[group] = _arrivals.get(group, 0) + 1
    base, key = _keys(group, n)
    store = _store()
    store.set(key(me), what)
    store.add(f"{base}/call/{what}", 1)
    if store.add(f"{base}/count", 1) == len(ranks):  # the last to arrive wakes the others
        store.set(f"{base}/done", "all")
    try:
        store.wait([f"{base}/done"], datetime.timedelta(seconds=timeout))
    except RuntimeError:
        missing = [r for r in ranks if not store.check([key(r)])]
        if missing:
            there = [r for r in ranks if r not in missing]
            raise CollectiveError(
                f"fzero: {what} is a collective call and {ranks_text(missing)} did not reach it within {timeout:g} s "
                f"({ranks_text(there)} did): call it on every rank (not under `if rank == 0:`). If a rank "
                "legitimately needs longer to get there, raise the timeout (zero1(call_timeout=...), "
                "shutdown(timeout=...)).") from None
    if store.get(f"{base}/done") == b"all" and int(store.add(f"{base}/call/{what}", 0)) == len(ranks):
        return
    calls = {r: store.get(key(r)).decode() if store.check([key(r)]) else "(not there yet)" for r in ranks}
    failed = {r: c for r, c in calls.items() if c.startswith("failed")}
    if failed:
        r, c = next(iter(failed.items()))
        raise CollectiveError(f"fzero: rank {r} {c}, so {what} on rank {me} cannot complete; that rank's error is the "
                              "cause")
    by_call: dict[str, list[int]] = {}
    for r, c in calls.items():
        by_call.setdefault(c, []).append(r)
    raise CollectiveError("fzero: ranks are in different collective calls: "
                          + "; ".join(f"{c} on {ranks_text(rs)}" for c, rs in by_call.items())
                          + ". Every rank must make the same fzero calls in the same order.")


def elsewhere(group: str) -> str:
    """Where a failed hot-path collective's peers are, for its message: ``" Meanwhile rank 0 is
    in checkpoint.save ..."`` when some rank of ``group`` (a name) has arrived in a collective
    fzero call that this rank has not made (a call under ``if rank == 0:``: that rank waits there
    while this one went on to its step), else ``""``. Best effort, on the error path only: the
    store may be gone with the rank that hosted it."""
    try:
        pg = dist.distributed_c10d._resolve_process_group(group)
        ranks, me, store = dist.get_process_group_ranks(pg), dist.get_rank(), _store()
        _, key = _keys(group, _arrivals.get(group, 0) + 1)
        calls = {r: store.get(key(r)).decode() for r in ranks if r != me and store.check([key(r)])}
    except (RuntimeError, ValueError, KeyError):
        return ""
    by_call: dict[str, list[int]] = {}
    for r, c in calls.items():
        by_call.setdefault(c, []).append(r)
    if not by_call:
        return ""
    return (" Meanwhile " + "; ".join(f"{ranks_text(rs)} {'is' if len(rs) == 1 else 'are'} in {c}"
                                      for c, rs in by_call.items())
            + ", which this rank never called: a collective fzero call made on some ranks only (under `if rank == "
            "0:`)? Call it on every rank.")


def report_failure(error: BaseException) -> None:
    """Tell the ranks waiting in (or about to make) an arrival in any group this process joined
    that this rank failed with ``error``: they raise at once, naming it, instead of waiting."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    line = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    store, me = _store(), dist.get_rank()
    groups = set(_arrivals) | {dist.group.WORLD.group_name}
    for group in groups:
        base, key = _keys(group, _arrivals.get(group, 0) + 1)
        try:
            store.set(key(me), f"failed ({line})"[:2000])
            store.set(f"{base}/done", "failed")
        except RuntimeError:  # the store is gone (its host exited): nobody is waiting on it
            pass


def reset() -> None:
    """Forget the arrivals (the process groups are destroyed: a new store starts from zero)."""
    _arrivals.clear()
