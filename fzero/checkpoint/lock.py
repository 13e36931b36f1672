"""The save lock: saves to one checkpoint path exclude each other.

Rank 0 of a save holds an exclusive ``flock`` on ``path/.fzero-checkpoint.lock`` from before it
records the new snapshot until the save's cleanup is done (steps 1 to 5 of
:mod:`fzero.checkpoint.commit`); ``recover`` takes it too. A save that finds it held (another
job saving to the same path: the orphaned workers of a killed launcher, two runs given one
output directory) fails at step 1, on every rank, having changed nothing, with the holder's pid
and host in the error. The kernel drops an flock when its process ends, however it ends
(kill -9 included), so a crashed save never leaves the path locked; the file itself stays
(deleting a lock file races with the next locker).

An flock is held on a file, not on its name: once the file is removed or replaced, another save
creates a new one and locks that, and the two saves no longer exclude each other. So the holder
checks that the file it locked is still the one at the path (:func:`check`), when it takes the
lock and again before it commits; if not, the save fails without committing.

The lock file is the one file fzero writes into in place (its holder's pid, host and start
time), so it is opened without following a symlink and without truncating, and it must be a
regular file with one link (a hard link could be another name for a file outside the
checkpoint); only then, with the lock held, is the holder written into it
(:mod:`fzero.checkpoint.files`).
"""
from __future__ import annotations

import fcntl
import os
import socket
import time

from . import files
from .strict_json import CheckpointError

__all__ = ["LOCK", "acquire", "check", "release"]

LOCK = ".fzero-checkpoint.lock"  # the lock file's name in a checkpoint directory


def acquire(path: str) -> int:
    """Take the save lock of the checkpoint directory ``path``: an exclusive, non-blocking
    ``flock`` on ``path/.fzero-checkpoint.lock`` (created if missing); its file descriptor, for
    :func:`release`. Held: ``CheckpointError`` naming the holder (it writes its pid, host and
    start time into the file). The kernel releases the lock when the holder's process ends,
    however it ends. A lock file that is a symlink or not a regular file, that has more than
    one link, or that is removed or replaced while it is taken: ``CheckpointError`` naming it."""
    file = os.path.join(path, LOCK)
    fd = files.open_regular(file, os.O_RDWR | os.O_CREAT)
    try:
        links = os.fstat(fd).st_nlink
        if links > 1:
            raise CheckpointError(f"{file} has {links} hard links: another name for it may be outside the checkpoint "
                                  "directory, and a save writes into it; remove it (the next save creates it)")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            for _ in range(10):  # the holder writes who it is just after taking the lock
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip()
                if holder:
                    break
                time.sleep(0.01)
            holder = holder or "holder unknown"
            raise CheckpointError(
                f"another save to {path} is in progress ({holder}); this save changed nothing: saves to one path "
                "exclude each other (wait for that one, stop its process, or save elsewhere)"
            ) from None
        except OSError as e:
            raise CheckpointError(f"cannot lock {file} ({e}): a checkpoint needs a filesystem with flock") from e
        check(fd, path, "while this save took it; it changed nothing")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check(fd: int, path: str, when: str = "during this save; it did not commit") -> None:
    """The lock ``fd`` (from :func:`acquire`) is still on the file at ``path/.fzero-checkpoint.lock``;
    else ``CheckpointError`` (ending with ``when``): a lock whose file was removed or replaced
    excludes nothing, another save may be running at the same time."""
    file = os.path.join(path, LOCK)
    mine = os.fstat(fd)
    try:
        now = os.lstat(file)
    except FileNotFoundError:
        now = None
    if now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
        raise CheckpointError(
            f"the save lock {file} was removed or replaced {when}: a lock on a file that is no longer there excludes "
            "no other save, and one may be running (do not delete the lock file while a save may run)"
        )


def release(fd: int) -> None:
    """Release a lock from :func:`acquire` (explicitly: a forked child sharing the descriptor
    would otherwise keep it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
