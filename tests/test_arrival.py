"""fzero.comm.arrival: a collective fzero call made on some ranks only, or a rank that fails while
the others wait, ends every rank in seconds with the cause named, never the group's timeout.

The harness's gloo group times out after 60 s: each test below would take at least that long
(and fail its time bound) if a rank were left waiting in a collective."""

import subprocess
import sys
import time

import pytest
import torch

import fzero
from fzero import transforms
from distributed import run_ranks

SHORT = 3.0  # call_timeout of these tests, seconds


def engine(**kw):
    return fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, **kw)


def params():
    return {"w": torch.ones(40, 3), "b": torch.zeros(3)}


def fails_inside_try_finally(rank, world_size):
    """The README's structure: rank 1 raises between steps; rank 0 is in the next step's
    reduce-scatter. Before: rank 1 waited in shutdown's barrier, rank 0 in the reduce-scatter."""
    try:
        eng = engine()
        p, state, ss = eng.init(params())
        if rank == 1:
            raise ValueError("bad batch on rank 1")
        eng.step(p, {"w": torch.ones(40, 3), "b": torch.ones(3)}, state, ss)
    finally:
        fzero.shutdown()


@pytest.mark.multirank
def test_a_rank_raising_inside_try_finally_shutdown_ends_every_rank_in_seconds():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        run_ranks(fails_inside_try_finally, 2, timeout=120)
    assert time.monotonic() - t0 < 30
    text = str(e.value)
    assert "--- rank 1 ---" in text and "ValueError: bad batch on rank 1" in text  # its traceback is shown
    assert "--- rank 0 ---" in text and "reduce_scatter of grads" in text  # the peer stopped too, saying where


def init_on_rank_0_only(rank, world_size):
    """``init`` under ``if rank == 0:`` and the script goes on to its end (shutdown)."""
    t0 = time.monotonic()
    try:
        if rank == 0:
            engine(call_timeout=120).init(params())
        fzero.shutdown(timeout=120)
    except fzero.CollectiveError as err:
        return str(err), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.multirank
def test_init_on_some_ranks_only_names_each_ranks_call_at_once():
    results = run_ranks(init_on_rank_0_only, 2, may_die=(0, 1))
    for msg, elapsed in results:
        assert msg == ("fzero: ranks are in different collective calls: engine.init on rank 0; fzero.shutdown on "
                       "rank 1. Every rank must make the same fzero calls in the same order.")
        assert elapsed < 30  # the mismatch is seen as soon as both arrive, not after a timeout


def missing_rank(rank, world_size):
    """Rank 0 initializes; rank 1 skipped the call and is busy elsewhere (not in an fzero call)."""
    t0 = time.monotonic()
    if rank == 1:
        time.sleep(2 * SHORT + 2)
        return None, 0.0
    try:
        engine(call_timeout=SHORT).init(params())
    except fzero.CollectiveError as err:
        return str(err), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.multirank
def test_a_rank_that_does_not_arrive_is_named_after_call_timeout():
    (msg, elapsed), _ = run_ranks(missing_rank, 2, may_die=(0, 1))
    assert msg.startswith("fzero: engine.init is a collective call and rank 1 did not reach it within 3 s (rank 0 did): "
                          "call it on every rank (not under `if rank == 0:`)")
    assert SHORT <= elapsed < SHORT + 10


def peer_failed_while_waiting(rank, world_size):
    """Rank 0 waits in init; rank 1 fails before reaching it, inside try/finally shutdown."""
    t0 = time.monotonic()
    if rank == 1:
        try:
            try:
                raise KeyError("no such dataset")
            finally:
                fzero.shutdown()
        except KeyError:
            return None, 0.0
    try:
        engine(call_timeout=120).init(params())
    except fzero.CollectiveError as err:
        return str(err), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.multirank
def test_a_peer_failing_ends_the_wait_at_once_naming_its_error():
    (msg, elapsed), _ = run_ranks(peer_failed_while_waiting, 2, may_die=(0, 1))
    assert msg == ("fzero: rank 1 failed (KeyError: 'no such dataset'), so engine.init on rank 0 cannot complete; "
                   "that rank's error is the cause")
    assert elapsed < 30


def test_call_timeout_must_be_positive():
    for bad in (0, -1.0, True, "60"):
        with pytest.raises(ValueError, match="call_timeout must be a positive number of seconds"):
            engine(call_timeout=bad)


@pytest.mark.multirank
def test_importing_fzero_after_init_process_group_is_named_as_the_cause():
    """The shutdown warning named the user's references to ProcessGroup objects as the cause."""
    code = (
        "import tempfile, warnings, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='file://' + tempfile.mktemp(), rank=0, world_size=1)\n"
        "import fzero\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    fzero.shutdown()\n"
        "print('|'.join(str(x.message) for x in w))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "fzero was imported after init_process_group" in out.stdout
    assert "import fzero before init_process_group" in out.stdout


def save_on_rank_0_only(rank, world_size, path):
    """``checkpoint.save`` under ``if rank == 0:``; rank 1 goes on to the next step (its
    reduce-scatter waits for rank 0). Before: both sat for the group's timeout."""
    t0 = time.monotonic()
    eng = engine(call_timeout=SHORT)
    p, state, ss = eng.init(params())
    try:
        if rank == 0:
            fzero.checkpoint.save(path, p, state, ss, eng)
        eng.step(p, {"w": torch.ones(40, 3), "b": torch.ones(3)}, state, ss)
    except (fzero.CollectiveError, fzero.checkpoint.CheckpointError) as err:
        return str(err), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.multirank
def test_save_on_one_rank_only_ends_both_ranks_naming_the_call(tmp_path):
    results = run_ranks(save_on_rank_0_only, 2, str(tmp_path / "ck"), may_die=(0, 1))
    (msg0, t0), (msg1, t1) = results
    assert msg0.startswith("fzero: checkpoint.save is a collective call and rank 1 did not reach it within 3 s")
    assert "reduce_scatter of grads" in msg1  # rank 0 gave up and left: rank 1's collective ends too
    assert t0 < SHORT + 10 and t1 < SHORT + 20
    assert not (tmp_path / "ck").exists()  # nothing written


def save_on_rank_0_only_then_exit(rank, world_size, tmp):
    """Rank 0 saves under ``if rank == 0:`` (and exits when the save gives up); rank 1 goes on to
    its step, whose reduce-scatter then fails: its message names what rank 0 was in."""
    import os

    from distributed import init_group

    init_group(rank, world_size, timeout=20)
    eng = engine(call_timeout=SHORT)
    p, state, ss = eng.init(params())
    if rank == 0:
        try:
            fzero.checkpoint.save(os.path.join(tmp, "ckpt"), p, state, ss, eng)
        finally:
            os._exit(3)
    try:
        eng.step(p, {"w": torch.ones(40, 3), "b": torch.ones(3)}, state, ss)
    except fzero.CollectiveError as e:
        return str(e)
    return "no error"


@pytest.mark.multirank
def test_a_peer_stuck_in_a_call_made_on_its_rank_only_is_named_by_the_failed_collective(tmp_path):
    out = run_ranks(save_on_rank_0_only_then_exit, 2, str(tmp_path), init=False, may_die=(0,), timeout=120)
    assert "reduce_scatter of grads" in out[1] and "Meanwhile rank 0 is in checkpoint.save" in out[1], out[1]
    assert "under `if rank == 0:`" in out[1], out[1]


def module_state_dict_on_rank_0_only(rank, world_size):
    """``fm.state_dict(..., engine=, state=)`` (collective) under ``if rank == 0:``."""
    fm = fzero.module.functional(torch.nn.Linear(3, 2))
    eng = engine(call_timeout=120)
    p, state, _ = eng.init(fm.params)
    try:
        if rank == 0:
            fm.state_dict(p, fm.buffers, engine=eng, state=state)
        fzero.shutdown(timeout=120)
    except fzero.CollectiveError as err:
        return str(err)
    return None


@pytest.mark.multirank
def test_a_module_state_dict_on_some_ranks_only_names_the_call_the_user_made():
    for msg in run_ranks(module_state_dict_on_rank_0_only, 2, may_die=(0, 1)):
        assert msg.startswith("fzero: ranks are in different collective calls: fzero.module state_dict/load_into on "
                              "rank 0; fzero.shutdown on rank 1"), msg
