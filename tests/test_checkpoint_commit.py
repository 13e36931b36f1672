"""The commit protocol (fzero.checkpoint.commit): crash safety at every point, what a save may
delete, loads racing saves, a damaged pointer and ``recover``.

Crash points are simulated in-process by a ``_hook`` passed to ``save`` that raises a
``BaseException`` the save does not catch (the files are then exactly as a kill leaves them);
one spawned run really kills a rank in the middle of its write. Loads racing saves: ``load``'s
``_hook`` saves between its phases (deterministic), and two spawned processes save and load the
same path over and over.
"""
import glob
import os
import re
import shutil
import time
import warnings

import optree
import pytest
import torch
from safetensors.torch import load_file

import fzero
from distributed import run_ranks
from fzero import checkpoint as ck
from fzero.checkpoint import commit, lock
from helpers import (
    CKPT_COMMITTED, CKPT_ONE, assert_views_equal, ckpt_engine, ckpt_entries, ckpt_fresh_engine, ckpt_params,
    ckpt_paths_shapes, ckpt_steps, ckpt_trained, file_contents, flip_byte, global_view, mixed_parts, snapshot_dir, tagged,
)


class Killed(BaseException):
    """Not an Exception: the save's error handling does not see it, as with a kill."""


def crash_at(point, truncate=False):
    def hook(where, **info):
        if where == point:
            if truncate:
                with open(info["file"], "r+b") as f:
                    f.truncate(os.path.getsize(info["file"]) // 2)
            raise Killed(where)

    return hook


@pytest.mark.parametrize(
    "point", ["snapshot_created", "shard_written", "manifest_written", "pointer_written", "committed"]
)
def test_crash_at_any_point_leaves_a_loadable_checkpoint(tmp_path, point):
    path = str(tmp_path / "ckpt")
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 2)
    ck.save(path, params, state, ss, engine, extra={"v": 1})
    old = global_view(engine, state, ss)
    params, state, ss = ckpt_steps(engine, params, state, ss, range(2, 4))
    new = global_view(engine, state, ss)

    with pytest.raises(Killed):
        ck.save(path, params, state, ss, engine, extra={"v": 2}, _hook=crash_at(point, truncate=point == "shard_written"))
    if point == "pointer_written":  # the new pointer was written, not yet moved into place
        assert [n for n in os.listdir(path) if n.startswith(f".{commit.POINTER}.tmp-")]

    fresh = ckpt_engine()
    fresh.init(ckpt_params(seed=9))
    _, s2, ss2, extra = ck.load(path, fresh)
    committed = point == "committed"
    assert extra == {"v": 2 if committed else 1}
    assert_views_equal(global_view(fresh, s2, ss2), new if committed else old)
    assert os.listdir(tmp_path) == ["ckpt"]  # a save never writes next to path

    # the next save deletes what the crashed one left (recorded in the marker) and nothing else
    before = commit.read_pointer(path)[0]
    ck.save(path, params, state, ss, engine, extra={"v": 3})
    assert ckpt_entries(path) == CKPT_COMMITTED and os.listdir(tmp_path) == ["ckpt"]
    assert before in os.listdir(path)  # the previous snapshot stays until the next save
    assert ck.load(path, fresh)[3] == {"v": 3}


@pytest.mark.parametrize("point", ["shard_written", "manifest_written"])
def test_crash_in_the_first_save_then_saves_that_complete(tmp_path, point):
    path = str(tmp_path / "ckpt")
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 2)
    with pytest.raises(Killed):
        ck.save(path, params, state, ss, engine, _hook=crash_at(point))
    with pytest.raises(ck.CheckpointError, match="no save to it has completed"):
        ck.load(path, ckpt_fresh_engine())
    (partial,) = [n for n in os.listdir(path) if n.startswith("snapshot-")]
    if point == "shard_written":  # no manifest: never committed, deleted without a word
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ck.save(path, params, state, ss, engine, extra={"v": 1})
        assert ckpt_entries(path) == CKPT_ONE
    else:  # complete but never committed: with no pointer the save cannot tell it from a
        # checkpoint whose pointer was lost, so it keeps it, as the previous one, and says so
        with pytest.warns(UserWarning, match=rf"{commit.POINTER} is missing .* kept {partial}"):
            ck.save(path, params, state, ss, engine, extra={"v": 1})
        assert ckpt_entries(path) == CKPT_COMMITTED and partial in os.listdir(path)
    assert ck.load(path, ckpt_fresh_engine())[3] == {"v": 1}
    ck.save(path, params, state, ss, engine, extra={"v": 2})
    assert ckpt_entries(path) == CKPT_COMMITTED and partial not in os.listdir(path)


def crash_rank1_mid_write(rank, world_size, tmp):
    path = os.path.join(tmp, "ckpt")
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 2)
    ck.save(path, params, state, ss, engine, extra={"v": 1})
    ck.export_full(os.path.join(tmp, "ref.safetensors"), state, engine)
    params, state, ss = ckpt_steps(engine, params, state, ss, range(2, 4))

    def die(where, **info):
        if where == "shard_written" and rank == 1:
            with open(info["file"], "r+b") as f:
                f.truncate(os.path.getsize(info["file"]) // 2)
            os._exit(1)  # no cleanup, no goodbye to the group

    try:
        ck.save(path, params, state, ss, engine, extra={"v": 2}, _hook=die)
    except ck.CheckpointError as e:  # rank 0 learns from the group that rank 1 is gone
        return str(e)
    return "saved"


@pytest.mark.multirank
def test_rank_killed_mid_write_keeps_previous_checkpoint(tmp_path):
    msg, dead = run_ranks(crash_rank1_mid_write, 2, str(tmp_path), timeout=90, may_die=(1,))
    assert dead is None and msg.startswith("save ") and "did one die?" in msg, msg
    path = str(tmp_path / "ckpt")
    # the surviving rank 0 removed the partial snapshot; the previous one is intact
    assert ckpt_entries(path) == CKPT_ONE
    assert sorted(os.listdir(snapshot_dir(path))) == ["manifest.json"] + [f"shard-0000{r}-of-00002.safetensors" for r in range(2)]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ref.safetensors"]
    engine = ckpt_engine()
    engine.init(ckpt_params(seed=3))
    params, state, ss, extra = ck.load(path, engine)
    assert extra == {"v": 1}
    ref = load_file(str(tmp_path / "ref.safetensors"))
    paths, _ = ckpt_paths_shapes()
    master = fzero.unflatten(state.master, engine.layout)
    for p, leaf in zip(paths, optree.tree_leaves(master)):
        assert torch.equal(leaf, ref[p]), p
    ck.save(path, params, state, ss, engine)
    assert ck.load(path, engine)[3] == {}


def test_save_keeps_siblings_and_unknown_files_and_refuses_foreign_directories(saved, tmp_path):
    path, engine, params, state, ss = saved
    backup = tmp_path / "ckpt.old-manual-backup"  # names an earlier protocol used for itself
    shutil.copytree(path, backup)
    (tmp_path / "ckpt.tmp-notes").write_text("mine")
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    stray = tmp_path / "ckpt" / ("snapshot-" + "0" * 32)  # a snapshot name the marker does not record
    stray.mkdir()
    (stray / "keep.txt").write_text("mine")
    ours_before = set(os.listdir(backup))
    for v in range(3):
        ck.save(path, params, state, ss, engine, extra={"v": v})
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.old-manual-backup", "ckpt.tmp-notes"]
    assert set(os.listdir(backup)) == ours_before and (tmp_path / "ckpt.tmp-notes").read_text() == "mine"
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "mine" and (stray / "keep.txt").read_text() == "mine"
    assert ckpt_entries(path) == sorted(CKPT_COMMITTED + ["notes.txt", "snapshot-*"])
    # load never reads a sibling in place of a missing path
    shutil.rmtree(path)
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.load(path, ckpt_fresh_engine())
    # a non-empty directory that is not fzero's, a file: refused, untouched
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.bin").write_bytes(b"x")
    with pytest.raises(ck.CheckpointError, match=r"refusing to overwrite .*data: it exists, is not empty and is not an fzero"):
        ck.save(str(tmp_path / "data"), params, state, ss, engine)
    assert os.listdir(tmp_path / "data") == ["x.bin"]
    with pytest.raises(ck.CheckpointError, match="refusing to overwrite .*ckpt.tmp-notes: it exists and is not a directory"):
        ck.save(str(tmp_path / "ckpt.tmp-notes"), params, state, ss, engine)
    (tmp_path / "empty").mkdir()  # an empty directory becomes a checkpoint
    ck.save(str(tmp_path / "empty"), params, state, ss, engine, extra={"v": "e"})
    assert ck.load(str(tmp_path / "empty"), ckpt_fresh_engine())[3] == {"v": "e"}


def test_save_through_a_symlink_writes_into_its_target(saved, tmp_path):
    path, engine, params, state, ss = saved
    link, target = tmp_path / "link", tmp_path / "real"
    os.symlink(target, link)  # dangling: the first save creates the target
    for v in range(3):
        ck.save(str(link), params, state, ss, engine, extra={"v": v})
    assert os.path.islink(link) and os.readlink(link) == str(target)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "link", "real"]  # no temporary links or directories
    assert ckpt_entries(target) == CKPT_COMMITTED
    assert ck.load(str(link), ckpt_fresh_engine())[3] == {"v": 2} == ck.load(str(target), ckpt_fresh_engine())[3]
    other = tmp_path / "link2"
    os.symlink(path, other)  # a link to an existing checkpoint
    ck.save(str(other), params, state, ss, engine, extra={"v": "via link"})
    assert os.path.islink(other) and ck.load(path, ckpt_fresh_engine())[3] == {"v": "via link"}


def test_a_load_reads_one_snapshot_while_saves_commit(saved):
    path, engine, params, state, ss = saved
    original = global_view(engine, state, ss)
    p2, s2, ss2 = ckpt_steps(engine, params, state, ss, range(3, 5))

    def save_once(point, **info):
        if point == "resolved":
            ck.save(path, p2, s2, ss2, engine, extra={"v": 2})

    fresh = ckpt_fresh_engine()
    _, s, sc, extra = ck.load(path, fresh, _hook=save_once)  # the snapshot read is kept by that save
    assert extra == {"epoch": 1, "seen": [1, 2]}
    assert_views_equal(global_view(fresh, s, sc), original)
    assert ck.load(path, fresh)[3] == {"v": 2}

    for at in ("resolved", "verified"):  # two saves: the snapshot being read is deleted
        def save_twice(point, **info):
            if point == at:
                for v in (3, 4):
                    ck.save(path, p2, s2, ss2, engine, extra={"v": v})

        with pytest.raises(ck.CheckpointError, match=r"was replaced while loading: .*snapshot-\w+/(manifest.json|shard-\S+) is gone"):
            ck.load(path, ckpt_fresh_engine(), _hook=save_twice)
    assert ck.load(path, ckpt_fresh_engine())[3] == {"v": 4}


RACE_SECONDS, RACE_SAVES = 3.0, 40


def race_save_and_load(rank, world_size, tmp):
    """Rank 0 saves tagged states to one path, over and over; rank 1 loads it meanwhile. Each
    is a one-process engine (no group): two independent programs sharing a directory."""
    path, ready, done = (os.path.join(tmp, name) for name in ("ckpt", "ready", "done"))
    engine = ckpt_engine()
    params, state, ss = engine.init(ckpt_params())
    if rank == 0:
        ck.save(path, *tagged(params, state, ss, 0), engine, extra={"tag": 0})
        deadline = time.monotonic() + 60
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.01)
        tag, start = 1, time.monotonic()
        while tag < 3 or (tag < RACE_SAVES and time.monotonic() - start < RACE_SECONDS):
            ck.save(path, *tagged(params, state, ss, tag), engine, extra={"tag": tag})
            tag += 1
        # Written aside and renamed into place: the loader takes ``done`` existing as the end and
        # reads it at once, and an ``open(done, "w")`` is visible, empty, before it is written.
        with open(done + ".tmp", "w") as f:
            f.write(str(tag - 1))
        os.replace(done + ".tmp", done)
        return {"saves": tag}
    out = {"loads": 0, "replaced": 0, "errors": [], "mixed": []}
    deadline = time.monotonic() + 90
    while not os.path.exists(os.path.join(path, commit.POINTER)) and time.monotonic() < deadline:
        time.sleep(0.01)
    open(ready, "w").close()
    finished = False
    while not finished and time.monotonic() < deadline:
        finished = os.path.exists(done)  # one more load after the last save
        try:
            _, s, sc, extra = ck.load(path, engine, hyperparams="checkpoint")
        except ck.CheckpointError as e:  # allowed: the snapshot went away (two saves) mid-load
            if "replaced while loading" in str(e):
                out["replaced"] += 1
            else:
                out["errors"].append(str(e))
            continue
        out["loads"] += 1
        mixed = mixed_parts(engine, s, sc, extra)
        if mixed:
            out["mixed"].append((extra["tag"], mixed))
        out["last"] = extra["tag"]
    out["final"] = int(open(done).read()) if os.path.exists(done) else None
    return out


@pytest.mark.multirank
def test_loads_racing_saves_are_never_mixed_nor_corrupted(tmp_path):
    saver, loader = run_ranks(race_save_and_load, 2, str(tmp_path), init=False, timeout=150)
    assert saver["saves"] >= 3
    assert loader["errors"] == [] and loader["mixed"] == [], loader
    assert loader["final"] == saver["saves"] - 1 and loader["last"] == loader["final"]  # the load after the last save
    assert loader["loads"] >= 1
    assert ckpt_entries(str(tmp_path / "ckpt")) == CKPT_COMMITTED


def damage_pointer(path, how):
    pointer = os.path.join(path, commit.POINTER)
    if how == "deleted":
        os.remove(pointer)
    else:
        os.truncate(pointer, os.path.getsize(pointer) // 2)


@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_a_damaged_pointer_keeps_the_intact_snapshot_and_recover_restores_it(saved, how):
    path, engine, params, state, ss = saved
    original, good = global_view(engine, state, ss), os.path.basename(snapshot_dir(path))
    damage_pointer(path, how)
    with pytest.raises(ck.CheckpointError) as e:
        ck.load(path, ckpt_fresh_engine())
    msg = str(e.value)
    assert f"{good} (no step)" in msg and f"fzero.checkpoint.recover({path!r})" in msg, msg
    assert ck.recover(path) == good  # verifies it, points current.json at it
    _, s, sc, _ = ck.load(path, ckpt_fresh_engine())
    assert_views_equal(global_view(engine, s, sc), original)

    damage_pointer(path, how)  # a save now keeps it (it cannot tell which snapshot was current)
    p2, s2, ss2 = ckpt_steps(engine, params, state, ss, range(3, 5))
    with pytest.warns(UserWarning, match=rf"kept {good}"):
        ck.save(path, p2, s2, ss2, engine, extra={"step": 5})
    assert good in os.listdir(path) and ck.load(path, ckpt_fresh_engine())[3] == {"step": 5}
    assert ck.recover(path, good) == good  # go back to it by name
    _, s, sc, _ = ck.load(path, ckpt_fresh_engine())
    assert_views_equal(global_view(engine, s, sc), original)


def test_recover_verifies_the_snapshot_first(saved):
    path, engine, params, state, ss = saved
    good = os.path.basename(snapshot_dir(path))
    damage_pointer(path, "deleted")
    flip_byte(shard_files_of(path, good)[0])
    # recover takes the save lock, which writes its holder (pid, host, the time to the second)
    # into the lock file: the one file recover may change
    unlocked = lambda: {k: v for k, v in file_contents(path).items() if k != lock.LOCK}  # noqa: E731
    before = unlocked()
    with pytest.raises(ck.CheckpointError, match=rf"{good}/shard-00000-of-00001.safetensors is corrupted"):
        ck.recover(path, good)
    with pytest.raises(ck.CheckpointError, match=rf"no snapshot in {re.escape(path)} passes verification: {good}: .* is corrupted"):
        ck.recover(path)
    with pytest.raises(ck.CheckpointError, match=r"no snapshot 'snapshot-0+' in"):
        ck.recover(path, "snapshot-" + "0" * 32)
    assert unlocked() == before  # nothing re-pointed


def shard_files_of(path, snapshot):
    return sorted(glob.glob(os.path.join(path, snapshot, "shard-*.safetensors")))
