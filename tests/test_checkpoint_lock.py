"""The save lock (fzero.checkpoint.lock): saves to one path exclude each other.

A save's ``_hook`` starts a second save while the first holds the lock (deterministic), two
spawned processes save to the same path over and over, and a saver killed holding the lock
does not block the next save. A lock file removed or replaced during a save (the hook does it
between the save's steps) makes that save fail instead of committing.
"""
import fcntl
import os
import re
import signal
import time
import warnings

import pytest

from distributed import run_ranks
from fzero import checkpoint as ck
from fzero.checkpoint import lock
from helpers import (
    CKPT_COMMITTED, CKPT_ONE, ckpt_engine, ckpt_entries, ckpt_fresh_engine, ckpt_params, ckpt_steps, ckpt_trained,
    file_contents, mixed_parts, tagged,
)


def test_a_save_while_another_is_in_progress_fails_and_changes_nothing(saved):
    path, engine, params, state, ss = saved
    p2, s2, ss2 = ckpt_steps(engine, params, state, ss, range(3, 5))
    seen = {}

    def contend(point, **info):
        if point == "shard_written":  # the first save holds the lock: a second one on the same path
            before = file_contents(path)
            with pytest.raises(ck.CheckpointError) as e:
                ck.save(path, p2, s2, ss2, engine, extra={"v": "second"})
            seen["error"], seen["unchanged"] = str(e.value), file_contents(path) == before

    ck.save(path, params, state, ss, engine, extra={"v": "first"}, _hook=contend)
    assert seen["unchanged"]
    assert seen["error"].startswith(f"another save to {path} is in progress (pid {os.getpid()} on "), seen["error"]
    assert "this save changed nothing" in seen["error"]
    assert ckpt_entries(path) == CKPT_COMMITTED and ck.load(path, ckpt_fresh_engine())[3] == {"v": "first"}


@pytest.mark.parametrize("how", ["removed, and another save ran", "replaced"])
def test_a_save_whose_lock_file_is_removed_or_replaced_does_not_commit(saved, how):
    """Once its file is gone, a lock excludes nothing: a second save takes a new lock file and
    its cleanup deletes the first save's snapshot. The first must then fail, not commit a
    pointer to a deleted snapshot; the second's checkpoint stays."""
    path, engine, params, state, ss = saved
    p2, s2, ss2 = ckpt_steps(engine, params, state, ss, range(3, 5))
    file = os.path.join(path, lock.LOCK)

    def lose_the_lock(point, **info):
        if point == "manifest_written":  # the first save's snapshot is complete, not committed
            if how == "replaced":
                with open(file + ".new", "w") as f:
                    f.write("someone else's")
                os.replace(file + ".new", file)
            else:
                os.remove(file)
                ck.save(path, p2, s2, ss2, engine, extra={"v": "second"})

    with pytest.raises(ck.CheckpointError, match=rf"the save lock {re.escape(file)} was removed or replaced during this "
                                                 "save; it did not commit"):
        ck.save(path, params, state, ss, engine, extra={"v": "first"}, _hook=lose_the_lock)
    want = {"v": "second"} if how != "replaced" else {"epoch": 1, "seen": [1, 2]}
    assert ck.load(path, ckpt_fresh_engine())[3] == want
    assert ckpt_entries(path) == (CKPT_COMMITTED if how != "replaced" else CKPT_ONE)  # the failed save left nothing
    ck.save(path, params, state, ss, engine, extra={"v": "next"})  # the new lock file works
    assert ck.load(path, ckpt_fresh_engine())[3] == {"v": "next"}


def test_a_lock_file_removed_as_it_is_taken_or_after_the_commit(saved, monkeypatch):
    """Removed between its open and its flock: the save changes nothing. Removed after the
    commit: the save is committed and leaves its cleanup to the next save, saying so."""
    path, engine, params, state, ss = saved
    file = os.path.join(path, lock.LOCK)
    flock = fcntl.flock

    def flock_then_remove(fd, op):
        flock(fd, op)
        if op & fcntl.LOCK_EX:
            os.remove(file)

    before = os.listdir(path)
    with monkeypatch.context() as m:
        m.setattr(fcntl, "flock", flock_then_remove)
        with pytest.raises(ck.CheckpointError, match=rf"the save lock {re.escape(file)} was removed or replaced while "
                                                     "this save took it; it changed nothing"):
            ck.save(path, params, state, ss, engine, extra={"v": "refused"})
        with pytest.raises(ck.CheckpointError, match="was removed or replaced while this save took it"):
            ck.recover(path)
    assert sorted(os.listdir(path)) == sorted(n for n in before if n != lock.LOCK)
    assert ck.load(path, ckpt_fresh_engine())[3] == {"epoch": 1, "seen": [1, 2]}

    ck.save(path, params, state, ss, engine, extra={"v": 1})
    old = set(os.listdir(path))

    def remove_after_commit(point, **info):
        if point == "committed":
            os.remove(file)

    with pytest.warns(UserWarning, match=rf"committed, but old snapshots were not removed: the save lock .* was removed "
                                         "or replaced after this save committed"):
        ck.save(path, params, state, ss, engine, extra={"v": 2}, _hook=remove_after_commit)
    assert ck.load(path, ckpt_fresh_engine())[3] == {"v": 2}
    assert old - {lock.LOCK} < set(os.listdir(path))  # nothing deleted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.save(path, params, state, ss, engine, extra={"v": 3})
    assert ckpt_entries(path) == CKPT_COMMITTED and ck.load(path, ckpt_fresh_engine())[3] == {"v": 3}


HAMMER_SECONDS = 2.0


def hammer_saves(rank, world_size, tmp):
    """Two independent one-process jobs (no group) saving to one path as fast as they can, as
    the orphaned workers of a killed launcher do; each save's tag says which job wrote it."""
    path = os.path.join(tmp, "ckpt")
    engine = ckpt_engine()
    params, state, ss = engine.init(ckpt_params())
    open(os.path.join(tmp, f"ready{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(tmp, f"ready{r}")) for r in range(world_size)):
        time.sleep(0.01)
    out = {"saved": [], "refused": 0, "errors": []}
    start, i = time.monotonic(), 0
    while time.monotonic() - start < HAMMER_SECONDS:
        tag = 1000 * (rank + 1) + i
        i += 1
        try:
            ck.save(path, *tagged(params, state, ss, tag), engine, extra={"tag": tag})
            out["saved"].append(tag)
        except ck.CheckpointError as e:
            if str(e).startswith(f"another save to {path} is in progress ("):
                out["refused"] += 1
            else:
                out["errors"].append(str(e))
    return out


@pytest.mark.multirank
def test_concurrent_savers_exclude_each_other_and_leave_no_orphans(tmp_path):
    path = str(tmp_path / "ckpt")
    engine = ckpt_engine()
    params, state, ss = engine.init(ckpt_params())
    ck.save(path, *tagged(params, state, ss, 1), engine, extra={"tag": 1})  # the previous checkpoint
    jobs = run_ranks(hammer_saves, 2, str(tmp_path), init=False, timeout=120)
    assert [j["errors"] for j in jobs] == [[], []], jobs
    saved_tags = {1} | {t for j in jobs for t in j["saved"]}
    _, s, sc, extra = ck.load(path, engine, hyperparams="checkpoint")
    assert extra["tag"] in saved_tags and mixed_parts(engine, s, sc, extra) == []
    assert len(saved_tags) >= 3
    ck.save(path, *tagged(params, state, ss, 2), engine, extra={"tag": 2})
    assert ckpt_entries(path) == CKPT_COMMITTED  # no snapshot left behind by either job


def save_then_die(rank, world_size, path):
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 2)

    def die(point, **info):
        if point == "shard_written":
            os.kill(os.getpid(), signal.SIGKILL)  # holding the lock

    ck.save(path, params, state, ss, engine, extra={"v": "dead"}, _hook=die)


@pytest.mark.multirank
def test_a_saver_killed_holding_the_lock_does_not_block_the_next_save(saved):
    path, engine, params, state, ss = saved
    assert run_ranks(save_then_die, 1, path, init=False, may_die=(0,)) == [None]
    assert ck.load(path, ckpt_fresh_engine())[3] == {"epoch": 1, "seen": [1, 2]}
    ck.save(path, params, state, ss, engine, extra={"v": "next"})  # the kernel dropped the dead one's lock
    assert ckpt_entries(path) == CKPT_COMMITTED and ck.load(path, ckpt_fresh_engine())[3] == {"v": "next"}
