"""``fzero.comm.store_exchange``: every participant's value in index order, round after round;
a participant that never posts is named after the timeout; ``post`` lets a leaving rank end its
peers' round; ``stop`` ends a wait at once.

The participants are threads sharing one in-process ``HashStore`` (each exchange polls ``check``
as it does on a rank's own store connection).
"""
import threading
import time

import pytest
import torch.distributed as dist

from fzero.comm.store_exchange import ExchangeStopped, StoreExchange


def exchanges(store, size, **kw):
    return [StoreExchange(store, "k", i, size, **kw) for i in range(size)]


def run_all(fns):
    """Each of ``fns`` in its own thread; their results (or exceptions), in order."""
    out = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 -- returned for the test to check
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_every_participant_gets_every_value_in_index_order_each_round(size):
    store = dist.HashStore()
    xs = exchanges(store, size, timeout=30)

    def two_rounds(x):
        return [x.all_gather_object({"i": x.index, "round": r}) for r in (1, 2)]

    results = run_all([lambda x=x: two_rounds(x) for x in reversed(xs)])  # started in reverse order
    for got in results:
        assert got == [[{"i": i, "round": r} for i in range(size)] for r in (1, 2)]
    assert not any(store.check([f"fzero/exchange/k/1/{i}"]) for i in range(size))  # round 1's keys deleted
    assert store.check([f"fzero/exchange/k/2/{i}" for i in range(size)])  # the last round's stay


def test_a_participant_that_never_posts_is_named_after_the_timeout():
    store = dist.HashStore()
    x = StoreExchange(store, "k", 0, 3, timeout=30, first_timeout=0.2)
    StoreExchange(store, "k", 1, 3).post("here")
    with pytest.raises(TimeoutError, match=r"^rank 2 did not take part within 0.2 s$"):
        x.all_gather_object("me")


def test_post_ends_the_round_for_the_others():
    store = dist.HashStore()
    leaving, staying = exchanges(store, 2, timeout=30)
    leaving.post(["failed", None])
    assert staying.all_gather_object([None, None]) == [["failed", None], [None, None]]


def test_stop_ends_a_wait_at_once():
    store = dist.HashStore()
    stop = threading.Event()
    x = StoreExchange(store, "k", 0, 2, timeout=600, stop=stop)
    start = time.monotonic()
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(ExchangeStopped, match="stopped in round 1, waiting for the other ranks"):
        x.all_gather_object("me")
    assert time.monotonic() - start < 30  # not the 600 s timeout


def test_one_participant_needs_no_store():
    assert StoreExchange(None, "k", 0, 1).all_gather_object({"a": 1}) == [{"a": 1}]
