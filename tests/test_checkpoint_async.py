"""``fzero.checkpoint.async_save``: the snapshot is the state of the call while training goes on,
saves commit in call order, the writer agrees through the store (never the process group), faults
reach the future, shutdown and exit wait, and a process killed at random moments of its
background writes always leaves a checkpoint that loads and verifies.

References: the state's global view taken at the call (``helpers.global_view``), loaded back
from the committed snapshot and compared bit for bit.
"""
import gc
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref

import optree
import pytest
import torch
import torch.distributed as dist

import fzero
from distributed import run_ranks, start_process
from fzero import checkpoint as ck
from fzero.checkpoint import background, manifest
from fzero.checkpoint.form import saved_form
from helpers import (
    CKPT_COMMITTED, assert_views_equal, ckpt_engine, ckpt_entries, ckpt_fresh_engine, ckpt_params, ckpt_steps,
    ckpt_trained, global_view, grads_like, snapshot_dir, unwritable_dir,
)


def view(engine, state, ss):
    """``helpers.global_view`` of the state as a checkpoint stores it (8-bit moments dequantized)."""
    return global_view(engine, saved_form(state, engine.shard_context), ss)


def loaded_view(path, moments=None):
    """The :func:`view` of the checkpoint at ``path``, loaded (verified) into a fresh engine."""
    engine = ckpt_fresh_engine(moments=moments)
    _, state, ss, extra = ck.load(path, engine)
    return view(engine, state, ss), extra


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("moments", [None, torch.int8])
def test_the_snapshot_is_the_state_of_the_call_while_training_goes_on(tmp_path, donate, moments):
    engine = ckpt_engine(moments, donate=donate)
    params, state, ss = ckpt_trained(engine, 2)
    master = state.master
    at_call = view(engine, state, ss)
    future = ck.async_save(tmp_path / "c", params, state, ss, engine, extra={"step": 2})
    assert isinstance(future, background.SaveFuture)
    params, state, ss = ckpt_steps(engine, params, state, ss, range(2, 5))  # writes the state in place when donated
    assert (state.master.data_ptr() == master.data_ptr()) == donate  # the case staging exists for
    assert future.result() is None
    loaded, extra = loaded_view(tmp_path / "c", moments)
    assert extra == {"step": 2}
    assert_views_equal(loaded, at_call)
    assert not torch.equal(loaded["master"], view(engine, state, ss)["master"])  # training did go on


def test_saves_commit_in_call_order_with_one_staging_buffer(tmp_path):
    engine = ckpt_engine(donate=True)
    params, state, ss = ckpt_trained(engine, 1)
    path, futures, views = tmp_path / "c", [], []
    for step in range(1, 4):
        views.append(global_view(engine, state, ss))
        futures.append(ck.async_save(path, params, state, ss, engine, extra={"step": step}))
        if step == 1:
            buffer = background.writer_of(engine).buffer.buffer
        assert background.writer_of(engine).buffer.buffer is buffer  # reused, not reallocated
        assert all(f.done() for f in futures[:-1])  # each save waited for the one before it
        params, state, ss = ckpt_steps(engine, params, state, ss, range(step, step + 1))
    assert futures[-1].result() is None
    loaded, extra = loaded_view(path)
    assert extra == {"step": 3}  # committed last
    assert_views_equal(loaded, views[-1])
    previous = [e for e in os.listdir(path) if e.startswith("snapshot-") and e != os.path.basename(snapshot_dir(path))]
    assert len(previous) == 1 and read_snapshot_step(path, previous[0]) == 2  # and the one before it
    ck.save(path, params, state, ss, engine, extra={"step": 4})
    assert ck.read_manifest(path)["step"] == 4 and ckpt_entries(path) == CKPT_COMMITTED
    ck.async_save(path, params, state, ss, engine, extra={"step": 5})
    assert ck.load(path, engine)[3] == {"step": 5}  # a load of the engine waits for its save in flight
    # the staging buffer holds the shard file's data: the real elements (no padding) of the rank's
    # [S] leaves, master, mu, nu in FP32 and the weight-decay mask as bool
    real = engine.layout.numel
    assert buffer.numel() == 3 * 4 * real + real


def read_snapshot_step(path, snapshot):
    with open(os.path.join(path, snapshot, manifest.MANIFEST)) as f:
        return json.load(f)["step"]


def test_the_staging_buffer_and_the_writer_go_with_their_engine(tmp_path):
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 1)
    ck.async_save(tmp_path / "c", params, state, ss, engine).result()
    writer = background.writer_of(engine)
    buffer, alive = weakref.ref(writer.buffer.buffer), weakref.ref(engine)
    thread = writer.thread
    del engine, params, state, ss, writer
    gc.collect()
    assert alive() is None and buffer() is None  # nothing of the saves keeps them
    thread.join(10)
    assert not thread.is_alive()  # the writer thread ended with its engine


def test_sync_save_and_async_save_write_the_same_files(tmp_path):
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 3)
    ck.save(tmp_path / "s", params, state, ss, engine, extra={"step": 3})
    ck.async_save(tmp_path / "a", params, state, ss, engine, extra={"step": 3}).result()
    s, a = ck.read_manifest(tmp_path / "s"), ck.read_manifest(tmp_path / "a")
    assert [f["sha256"] for f in s["files"]] == [f["sha256"] for f in a["files"]]  # the shard files, byte for byte
    assert {k: v for k, v in s.items() if k != "files"} == {k: v for k, v in a.items() if k != "files"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_the_writer_runs_at_the_nice_value_asked(tmp_path):
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 1)
    seen = []

    def hook(where, **info):
        if where == "shard_written":
            seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))

    for nice in (None, 0, 5):
        kw = {} if nice is None else {"writer_nice": nice}
        ck.async_save(tmp_path / "c", params, state, ss, engine, _hook=hook, **kw).result()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert [n for _, n in seen] == [19, base, 5] and all(name.startswith("fzero-checkpoint-writer") for name, _ in seen)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller's own is untouched
    for bad in (-1, 20, True, 1.5):
        with pytest.raises(ValueError, match="writer_nice must be an integer from 0 to 19"):
            ck.async_save(tmp_path / "c", params, state, ss, engine, writer_nice=bad)


def test_argument_errors_raise_at_the_call_and_nothing_is_staged(tmp_path):
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 1)
    with pytest.raises(ck.CheckpointError, match="state must be the ZeroState"):
        ck.async_save(tmp_path / "c", params, params, ss, engine)
    with pytest.raises(TypeError, match=r"async_save\(path, params, state, scaler_state, engine\): the engine argument"):
        ck.async_save(tmp_path / "c", params, state, engine, ss)
    with pytest.raises(ck.CheckpointError, match="NaN"):
        ck.async_save(tmp_path / "c", params, state, ss, engine, extra={"x": float("nan")})
    assert background.writer_of(engine).buffer.nbytes == 0 and not os.path.exists(tmp_path / "c")


@pytest.mark.parametrize("where", ["a path under a regular file", "an unwritable directory"])
def test_bad_paths_reach_the_future_naming_the_path_and_the_next_save_works(tmp_path, where):
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 2)
    if where == "a path under a regular file":
        (tmp_path / "file").write_text("x")
        bad = str(tmp_path / "file" / "ckpt")
    else:
        bad = os.path.join(unwritable_dir(tmp_path), "ckpt")
    future = ck.async_save(bad, params, state, ss, engine)
    error = future.exception()
    assert isinstance(error, ck.CheckpointError) and bad in str(error), error
    with pytest.raises(ck.CheckpointError, match=re.escape(f"save {bad}: ")):
        future.result()
    good = tmp_path / "good"
    ck.async_save(good, params, state, ss, engine, extra={"step": 2}).result()
    assert_views_equal(loaded_view(good)[0], global_view(engine, state, ss))


def full_disk(rank, world_size, tmp):
    """The shard file outgrows the file-size limit mid-write (``EFBIG``, as a full disk's
    ``ENOSPC`` would stop it): the future raises naming the file; the previous snapshot stays."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing the process
    path = os.path.join(tmp, "c")
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 2)
    ck.save(path, params, state, ss, engine, extra={"step": 2})
    before = global_view(engine, state, ss)
    params, state, ss = ckpt_steps(engine, params, state, ss, range(2, 3))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))  # the marker fits, the shard file does not
    try:
        error = ck.async_save(path, params, state, ss, engine, extra={"step": 3}).exception()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    loaded_before = loaded_view(path)
    ck.async_save(path, params, state, ss, engine, extra={"step": 3}).result()
    return str(error), before, loaded_before, global_view(engine, state, ss), loaded_view(path), ckpt_entries(path)


@pytest.mark.multirank
def test_a_write_that_fails_midway_reaches_the_future_and_the_previous_checkpoint_stays(tmp_path):
    error, before, (loaded_before, extra_before), after, (loaded_after, extra_after), entries = run_ranks(
        full_disk, 1, str(tmp_path))[0]
    assert "File too large" in error and os.path.join(str(tmp_path), "c", "snapshot-") in error, error
    assert extra_before == {"step": 2} and extra_after == {"step": 3}
    assert_views_equal(loaded_before, before)
    assert_views_equal(loaded_after, after)
    assert entries == CKPT_COMMITTED  # the failed save's partial snapshot was removed


def save_while_training(rank, world_size, tmp):
    """Async saves while the loop's own collectives run; a failure on rank 1 only; the threads
    that called the process group's object collectives."""
    callers = []
    gather = dist.all_gather_object

    def spy(*args, **kw):
        callers.append(threading.current_thread().name)
        return gather(*args, **kw)

    dist.all_gather_object = spy
    engine = ckpt_engine(donate=True)
    params, state, ss = ckpt_trained(engine, 2)
    views, futures = {}, []
    for step in range(2, 5):
        views[step] = global_view(engine, state, ss)  # all-gathers on the loop's group, writes in flight
        futures.append(ck.async_save(os.path.join(tmp, f"c{step}"), params, state, ss, engine, extra={"step": step}))
        params, state, ss = ckpt_steps(engine, params, state, ss, range(step, step + 1))
    assert [f.result() for f in futures] == [None] * 3

    def fail(where, **info):
        if where == "shard_written" and rank == 1:
            raise OSError(28, "No space left on device")

    error = str(ck.async_save(os.path.join(tmp, "c4"), params, state, ss, engine, _hook=fail).exception())
    ck.async_save(os.path.join(tmp, "c5"), params, state, ss, engine, extra={"step": 5}).result()
    views[5] = global_view(engine, state, ss)
    dist.all_gather_object = gather
    # rank 1's arguments are wrong: it raises at the call, and rank 0's future names it
    try:
        wrong = ck.async_save(os.path.join(tmp, "c6"), params, params if rank == 1 else state, ss, engine)
        wrong = str(wrong.exception())
    except ck.CheckpointError as e:
        wrong = f"at the call: {e}"
    # rank 1 does not make the call (the last background save of the group: the ranks' counts
    # differ after it); rank 0's writer waits the engine's call_timeout for it
    engine.call_timeout = 1.0
    missing = str(ck.async_save(os.path.join(tmp, "c7"), params, state, ss, engine).exception()) if rank == 0 else None
    return views, error, sorted(set(callers)), wrong, missing


@pytest.mark.multirank
def test_two_ranks_save_in_the_background_agreeing_through_the_store(tmp_path):
    results = run_ranks(save_while_training, 2, str(tmp_path))
    (views, error, callers, wrong, missing), (_, error1, callers1, wrong1, _) = results
    assert error == error1, (error, error1)  # the same error on every rank
    assert wrong1 == "at the call: state must be the ZeroState from engine.init/step, got dict", wrong1
    assert wrong == f"save {tmp_path / 'c6'}: rank 1: state must be the ZeroState from engine.init/step, got dict", wrong
    assert missing.startswith(f"save {tmp_path / 'c7'}: rank 0 could not agree with the other ranks") and \
        missing.endswith("rank 1 did not take part within 1 s"), missing
    assert error.startswith(f"save {tmp_path / 'c4'}: rank 1: OSError: [Errno 28] No space left on device"), error
    assert callers == callers1 == ["MainThread"]  # the writer thread never used the process group
    for step in (2, 3, 4, 5):
        loaded, extra = loaded_view(tmp_path / f"c{step}")  # at world size 1
        assert extra == {"step": step}
        assert_views_equal(loaded, views[step])


def test_shutdown_waits_for_the_save_in_flight_and_reports_an_unasked_failure(tmp_path):
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 2)
    good = ck.async_save(tmp_path / "good", params, state, ss, engine, extra={"step": 2})
    fzero.shutdown()  # no process group: it only waits
    assert good.done()
    (tmp_path / "file").write_text("x")
    ck.async_save(tmp_path / "file" / "c", params, state, ss, engine)  # its future dropped
    with pytest.warns(RuntimeWarning, match=r"async_save to .*file/c failed, and its future was never asked"):
        fzero.shutdown()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fzero.shutdown()  # reported once


# The first line of a script: at its very end (the exit hook registered first runs last), whether
# fzero's writer thread is still alive, which the finalizing interpreter would end inside a torch
# call (``fzero.checkpoint.background``'s module doc).
WRITER_AT_END = ("import atexit, threading; atexit.register(lambda: print('writer thread', 'alive' if any("
                 "t.name == 'fzero-checkpoint-writer' for t in threading.enumerate()) else 'ended', flush=True))")

EXITING = WRITER_AT_END + """
import sys, torch
sys.path.insert(0, {tests!r})
from helpers import ckpt_engine, ckpt_trained
from fzero import checkpoint as ck
engine = ckpt_engine()
params, state, ss = ckpt_trained(engine, 2)
ck.async_save({good!r}, params, state, ss, engine, extra={{"step": 2}})
ck.async_save({bad!r}, params, state, ss, engine)
print("returned", flush=True)
"""


@pytest.mark.multirank
def test_interpreter_exit_waits_for_the_write_and_reports_its_failure(tmp_path):
    (tmp_path / "file").write_text("x")
    good, bad = str(tmp_path / "good"), str(tmp_path / "file" / "c")
    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", EXITING.format(tests=tests, good=good, bad=bad)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stdout == "returned\nwriter thread ended\n", out.stderr
    assert ck.read_manifest(good)["step"] == 2  # the first save was committed before the process ended
    assert f"async_save to {bad} failed, and its future was never asked" in out.stderr, out.stderr


PEER_DIES = WRITER_AT_END + """
import datetime, os, sys, time
sys.path.insert(0, {tests!r})
import torch.distributed as dist
from helpers import ckpt_engine, ckpt_steps, ckpt_trained
from fzero import checkpoint as ck
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + {rendezvous!r}, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
engine = ckpt_engine(call_timeout=2.0)
params, state, ss = ckpt_trained(engine, 2)

def die(where, **info):
    if where == "shard_written" and rank == 1:
        os._exit(3)  # rank 1 dies in the middle of the save, in its writer thread

ck.async_save({path!r}, params, state, ss, engine, _hook=die)
if rank == 1:
    time.sleep(100)  # never steps: its writer ends it
ckpt_steps(engine, params, state, ss, range(2, 4))  # rank 0: its peer dies, the step raises, uncaught
"""


@pytest.mark.multirank
def test_a_peer_dying_mid_save_does_not_hold_the_survivor_at_exit(tmp_path):
    """The survivor's writer would wait for the dead rank's part of the save until the store's
    timeout (120 s here); the survivor's step fails when its peer dies, and its exit through that
    exception waits only the engine's call_timeout (2 s) for the save, says it did not, and stops
    the writer thread before the interpreter ends."""
    tests = os.path.dirname(os.path.abspath(__file__))
    script = PEER_DIES.format(tests=tests, rendezvous=str(tmp_path / "rendezvous"), path=str(tmp_path / "c"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(2)]
    out1, _ = procs[1].communicate(timeout=120)
    start = time.monotonic()
    out0, err0 = procs[0].communicate(timeout=120)
    assert procs[1].returncode == 3
    assert procs[0].returncode == 1 and time.monotonic() - start < 60, err0  # not the store's 120 s
    assert out0 == "writer thread ended\n", (out0, err0)
    assert f"async_save to {tmp_path / 'c'} was still writing when the script ended with an exception; not " \
           "waited for beyond 2 s" in err0, err0
    assert "Traceback" in err0  # the step's own error is shown


# ------------------------------------------------------------------ killed during background writes
KILLS = 20
BIG = (300, 300)  # 90k more elements: each write takes long enough to be caught in the middle


def big_grads(step, scale):
    return optree.tree_map(lambda g: (g * scale).to(torch.float16), grads_like(ckpt_params(z_shape=BIG), step))


def keep_saving(path, progress):
    """Train and save in the background every step, until killed; ``progress``: a file that gets
    a line per save started."""
    torch.set_num_threads(1)
    engine = ckpt_engine(donate=True)
    params, state, ss = engine.init(ckpt_params(z_shape=BIG))
    step = 0
    while True:
        params, state, ss, _ = engine.step(params, big_grads(step, ss.scale), state, ss)
        step += 1
        ck.async_save(path, params, state, ss, engine, extra={"step": step})
        with open(progress, "a") as f:
            f.write(f"{step}\n")


def reference_views(upto):
    engine = ckpt_engine(donate=True)
    params, state, ss = engine.init(ckpt_params(z_shape=BIG))
    views = {}
    for step in range(upto):
        params, state, ss, _ = engine.step(params, big_grads(step, ss.scale), state, ss)
        views[step + 1] = global_view(engine, state, ss)
    return views


@pytest.mark.multirank
@pytest.mark.slow
def test_killed_at_random_moments_of_background_writes_every_survivor_loads_and_verifies(tmp_path):
    path, progress, rng = str(tmp_path / "c"), str(tmp_path / "progress"), random.Random(0)
    steps, committed, midway = [], False, 0
    for kill in range(KILLS):
        open(progress, "w").close()
        proc = start_process(keep_saving, path, progress)
        deadline = time.monotonic() + 60
        while os.path.getsize(progress) == 0 and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)  # until its first save is in flight
        time.sleep(rng.uniform(0.0, 0.25))
        proc.kill()  # SIGKILL
        proc.join()
        assert proc.exitcode == -signal.SIGKILL, f"kill {kill}: the saving process ended by itself ({proc.exitcode})"
        engine = ckpt_engine(donate=True)
        engine.init(ckpt_params(seed=1, z_shape=BIG))
        try:
            _, state, ss, extra = ck.load(path, engine)  # verify=True: every shard file's sha256
        except ck.CheckpointError as e:  # only before the first save to the path ever committed
            assert not committed and "no save to it has completed" in str(e), (kill, e)
            continue
        committed = True
        entries = ckpt_entries(path)  # a save caught unfinished: a third snapshot, or a temporary file of its own
        midway += entries.count("snapshot-*") > 2 or any(".tmp-" in name for name in entries)
        steps.append((extra["step"], global_view(engine, state, ss)))
    assert committed and len(steps) >= KILLS // 2, len(steps)
    assert midway >= KILLS // 5, midway  # the kills did land inside saves (about 12 of 20 do)
    views = reference_views(max(s for s, _ in steps))
    for step, view in steps:
        assert_views_equal(view, views[step])
    engine = ckpt_engine()
    ck.save(path, *engine.init(ckpt_params(z_shape=BIG)), engine)
    assert ckpt_entries(path) == CKPT_COMMITTED  # whatever the kills left was removed
