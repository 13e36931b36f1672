"""The save lock: saves to one checkpoint path exclude each other.

Rank 0 of a save holds an exclusive ``flock`` on ``path/.fzero-checkpoint.lock`` from before it
records the new snapshot until the save's cleanup is done (steps 1 to 5 of
:mod:`fzero.checkpoint.commit`); ``recover`` takes it too. A save that finds it held (another
job saving to the same path: the orphaned workers of a killed launcher, two runs given one
output directory) fails at step 1, on every rank, having changed nothing, with the holder's pid
and host in the error. The kernel drops an flock when its process ends, however it ends
(kill -9 included), so a crashed save never leaves the path locked; the file itself stays
(deleting a lock file races with the next locker).
"""
from __future__ import annotations

import fcntl
import os
import socket
import time

from .strict_json import CheckpointError

__all__ = ["LOCK", "acquire", "release"]

LOCK = ".fzero-checkpoint.lock"  # the lock file's name in a checkpoint directory


def acquire(path: str) -> int:
    """Take the save lock of the checkpoint directory ``path``: an exclusive, non-blocking
    ``flock`` on ``path/.fzero-checkpoint.lock``; its file descriptor, for :func:`release`.
    Held: ``CheckpointError`` naming the holder (it writes its pid, host and start time into the
    file). The kernel releases the lock when the holder's process ends, however it ends."""
    file = os.path.join(path, LOCK)
    fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        for _ in range(10):  # the holder writes who it is just after taking the lock
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip()
            if holder:
                break
            time.sleep(0.01)
        os.close(fd)
        holder = holder or "holder unknown"
        raise CheckpointError(
            f"another save to {path} is in progress ({holder}); this save changed nothing: saves to one path "
            "exclude each other (wait for that one, stop its process, or save elsewhere)"
        ) from None
    except OSError as e:
        os.close(fd)
        raise CheckpointError(f"cannot lock {file} ({e}): a checkpoint needs a filesystem with flock") from e
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
    return fd


def release(fd: int) -> None:
    """Release a lock from :func:`acquire` (explicitly: a forked child sharing the descriptor
    would otherwise keep it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
