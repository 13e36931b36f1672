"""What fzero touches in a checkpoint directory (fzero.checkpoint.files): nothing outside it.

A checkpoint directory may come from elsewhere. Its entries -- the lock, the pointer, the
marker, the snapshots, leftover temporary files -- replaced by symlinks to files outside it (or
to nothing), by a hard link, or by a FIFO: every save, load and recover either refuses with one
CheckpointError naming the entry, or works, and nothing outside the directory is written,
created or deleted, and nothing blocks. A path that is not valid UTF-8 is refused.
"""
import os
import re
import shutil
import stat
import threading

import pytest

from fzero import checkpoint as ck
from fzero.checkpoint import commit, lock
from helpers import ckpt_fresh_engine, ckpt_steps, snapshot_dir


def listing(path):
    """Every entry under ``path``, symlinks not followed: a link's target, a file's bytes, or its
    kind; the lock file's bytes (its holder, written by every save and recover) left out."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            if name == lock.LOCK:
                out[name] = "the lock"
                continue
            entry = os.path.join(root, name)
            mode = os.lstat(entry).st_mode
            if stat.S_ISLNK(mode):
                out[os.path.relpath(entry, path)] = ("link", os.readlink(entry))
            elif stat.S_ISREG(mode):
                with open(entry, "rb") as f:
                    out[os.path.relpath(entry, path)] = f.read()
            else:
                out[os.path.relpath(entry, path)] = stat.S_IFMT(mode)
    return out


def outside_file(tmp_path):
    file = tmp_path / "outside.txt"
    file.write_text("not fzero's")
    return str(file)


LOCK_TARGETS = ["symlink to a file", "symlink to nothing", "hard link"]


@pytest.mark.parametrize("how", LOCK_TARGETS)
def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(saved, tmp_path, how):
    path, engine, params, state, ss = saved
    target, file = outside_file(tmp_path), os.path.join(path, lock.LOCK)
    os.remove(file)
    if how == "symlink to a file":
        os.symlink(target, file)
    elif how == "symlink to nothing":
        target = str(tmp_path / "created-by-no-one")
        os.symlink(target, file)
    else:
        os.link(target, file)
    before = listing(path)
    want = "is a symbolic link, not a regular file" if how != "hard link" else "has 2 hard links"
    for call in (lambda: ck.save(path, params, state, ss, engine, extra={"v": 2}), lambda: ck.recover(path)):
        with pytest.raises(ck.CheckpointError, match=f"{re.escape(file)} {want}"):
            call()
    assert listing(path) == before
    if how == "symlink to nothing":
        assert not os.path.lexists(target)  # not created
    else:
        with open(target) as f:
            assert f.read() == "not fzero's"  # not truncated, no pid written into it
    assert ck.load(path, ckpt_fresh_engine())[3] == {"epoch": 1, "seen": [1, 2]}  # loads take no lock
    os.remove(file)  # the remedy the error names: the next save creates the lock file
    ck.save(path, params, state, ss, engine, extra={"v": 2})
    assert ck.load(path, ckpt_fresh_engine())[3] == {"v": 2}


@pytest.mark.parametrize("entry", ["pointer", "marker", "leftover temporary file", "old snapshot", "current snapshot"])
@pytest.mark.parametrize("dangling", [False, True], ids=["to outside", "to nothing"])
def test_an_entry_that_is_a_symlink_is_refused_and_nothing_outside_changes(saved, tmp_path, entry, dangling):
    """A save refuses before it changes anything; the old snapshot's link is the one a save's
    cleanup would have deleted (with its target's files), the current one's the one a load reads."""
    path, engine, params, state, ss = saved
    ck.save(path, *ckpt_steps(engine, params, state, ss, range(3, 5)), engine, extra={"v": 1})  # two snapshots
    current = os.path.basename(snapshot_dir(path))
    (old,) = [n for n in os.listdir(path) if commit.SNAPSHOT.fullmatch(n) and n != current]
    name = {"pointer": commit.POINTER, "marker": commit.MARKER, "leftover temporary file": ".current.json.tmp-0123456789ab",
            "old snapshot": old, "current snapshot": current}[entry]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    link, target = os.path.join(path, name), str(outside / name)
    if os.path.exists(link):
        shutil.move(link, target)  # the real entry, moved out of the checkpoint
    else:
        with open(target, "w") as f:
            f.write("not fzero's")
    if dangling:
        shutil.move(target, target + ".moved")  # the link points to nothing
    os.symlink(target, link)
    before, outside_before = listing(path), listing(str(outside))

    refused = re.escape(link) + " is a symbolic link, not a (regular file|snapshot directory)"
    with pytest.raises(ck.CheckpointError, match=refused):
        ck.save(path, params, state, ss, engine, extra={"v": 2})
    if entry in ("pointer", "marker"):  # recover replaces them too
        with pytest.raises(ck.CheckpointError, match=refused):
            ck.recover(path, old)
    if entry in ("pointer", "current snapshot"):  # what a load reads
        with pytest.raises(ck.CheckpointError, match=refused):
            ck.load(path, ckpt_fresh_engine())
    assert listing(path) == before and listing(str(outside)) == outside_before
    assert not os.path.lexists(target) if dangling else os.path.exists(target)


def test_the_cleanup_never_deletes_through_a_symlink(saved, tmp_path):
    """Made a link after the save's checks (as by a racing process): the save commits and
    leaves the link and its target alone; a later save refuses it."""
    path, engine, params, state, ss = saved
    old = os.path.basename(snapshot_dir(path))
    ck.save(path, params, state, ss, engine, extra={"v": 1})
    target = str(tmp_path / "elsewhere")

    def swap(point, **info):
        if point == "committed":  # the cleanup deletes ``old``, the snapshot before the previous one
            shutil.move(os.path.join(path, old), target)
            os.symlink(target, os.path.join(path, old))

    with pytest.warns(UserWarning, match=f"committed, but old snapshots were not all removed .*{old} is a symbolic link"):
        ck.save(path, params, state, ss, engine, extra={"v": 2}, _hook=swap)
    assert ck.load(path, ckpt_fresh_engine())[3] == {"v": 2}
    assert os.path.islink(os.path.join(path, old))
    assert sorted(os.listdir(target)) == ["manifest.json", "shard-00000-of-00001.safetensors"]  # not deleted
    with pytest.raises(ck.CheckpointError, match=f"{old} is a symbolic link, not a snapshot directory"):
        ck.save(path, params, state, ss, engine, extra={"v": 3})


class Fifo:
    """A FIFO in place of ``file``, with a writer that opens it whenever a reader does: a read
    that would block ends (at end of file) instead of hanging the test, and the test then fails
    on the error it expected."""

    def __init__(self, file):
        self.file, self.done = file, False
        os.remove(file)
        os.mkfifo(file)
        self.writer = threading.Thread(target=self._write, daemon=True)
        self.writer.start()

    def _write(self):
        while not self.done:
            os.close(os.open(self.file, os.O_WRONLY))  # returns once a reader has it open

    def close(self):
        self.done = True
        reader = os.open(self.file, os.O_RDONLY | os.O_NONBLOCK)  # held open: the writer's last open returns
        try:
            self.writer.join(timeout=30)
        finally:
            os.close(reader)
        assert not self.writer.is_alive()


@pytest.mark.parametrize("entry", ["pointer", "manifest", "shard", "lock"])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(saved, entry):
    path, engine, params, state, ss = saved
    snapshot = snapshot_dir(path)
    file = {"pointer": os.path.join(path, commit.POINTER), "manifest": os.path.join(snapshot, "manifest.json"),
            "shard": os.path.join(snapshot, "shard-00000-of-00001.safetensors"),
            "lock": os.path.join(path, lock.LOCK)}[entry]
    fifo = Fifo(file)
    try:
        want = re.escape(f"{file} is a FIFO (named pipe), not a regular file")
        calls = {"pointer": ["load", "read_manifest", "save"], "manifest": ["load", "read_manifest", "recover"],
                 "shard": ["load", "recover"], "lock": ["save"]}[entry]
        for call in calls:
            with pytest.raises(ck.CheckpointError, match=want):
                {"load": lambda: ck.load(path, ckpt_fresh_engine()), "read_manifest": lambda: ck.read_manifest(path),
                 "save": lambda: ck.save(path, params, state, ss, engine),
                 "recover": lambda: ck.recover(path, os.path.basename(snapshot))}[call]()
    finally:
        fifo.close()


def test_a_path_that_is_not_utf8_is_refused(saved, tmp_path):
    """safetensors opens files by UTF-8 names only: such a checkpoint would save but never load."""
    path, engine, params, state, ss = saved
    bad = os.fsdecode(os.fsencode(str(tmp_path)) + b"/ck\xff")
    want = r"checkpoint path b'.*/ck\\xff' is not valid UTF-8"
    with pytest.raises(ck.CheckpointError, match=want):
        ck.save(bad, params, state, ss, engine)
    assert not os.path.lexists(bad)  # nothing created
    os.rename(path, bad)  # one made by other means
    for call in (lambda: ck.load(bad, ckpt_fresh_engine()), lambda: ck.read_manifest(bad), lambda: ck.recover(bad)):
        with pytest.raises(ck.CheckpointError, match=want):
            call()
    os.rename(bad, path)
    assert ck.load(os.fsencode(path), ckpt_fresh_engine())[3] == {"epoch": 1, "seen": [1, 2]}  # a bytes path is fine
