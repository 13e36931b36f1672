"""How fzero touches the entries of a checkpoint directory: only regular files and directories
inside it, never through a symlink, never blocking.

A checkpoint directory is input that may come from elsewhere (copied, unpacked, shared, crafted):
nothing fzero does with it may write, truncate, create or delete a file outside it, and no read
may block. So:

* every file fzero reads in it (pointer, marker, manifest, shard) is opened with
  ``O_NOFOLLOW | O_NONBLOCK`` and must be a regular file (:func:`open_regular`,
  :func:`read_file`, :func:`regular_size`): a symlink, a FIFO, a device or a directory in its
  place raises :class:`CheckpointError` naming it (a FIFO never blocks the open);
* every file fzero creates in it is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``
  (:func:`create`, :func:`write_new`): an existing entry is never opened for writing, so a
  planted link is refused, not followed;
* an entry fzero replaces (``os.replace`` of the pointer and the marker) or deletes (its
  temporary files, its snapshot directories) is checked with ``lstat`` first
  (:func:`check_entry`): a regular file, a real directory for a snapshot, or missing;
* the lock file, the one file fzero writes into in place, is checked the same way when opened
  and must have one link (:mod:`fzero.checkpoint.lock`);
* a checkpoint path that is not valid UTF-8 is refused (:func:`utf8`): safetensors opens files
  by UTF-8 names only, so a checkpoint there could be saved but never loaded.

``path`` itself may be a symlink (a checkpoint goes into its target); the entries in it may not.
"""
from __future__ import annotations

import errno
import os
import stat

from .strict_json import CheckpointError

__all__ = ["absolute", "utf8", "refuse", "check_entry", "open_regular", "read_file", "regular_size", "create",
           "write_new"]

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def absolute(path) -> str:
    """``path`` (str, bytes or path-like) as an absolute ``str``; bytes that are not valid UTF-8
    become surrogate escapes (``os.fsdecode``), which :func:`utf8` refuses."""
    return os.path.abspath(os.fsdecode(path))


def utf8(path: str) -> str:
    """``path``, if it is valid UTF-8; else ``CheckpointError`` naming it."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointError(
            f"checkpoint path {os.fsencode(path)!r} is not valid UTF-8: the shard files are safetensors files, "
            "which are opened by UTF-8 names only, so a checkpoint there could never be loaded; give a UTF-8 path"
        ) from None
    return path


def refuse(entry: str, mode: int, want: str = "a regular file") -> CheckpointError:
    """The error for ``entry`` (its ``st_mode``: ``mode``) found where fzero needs ``want``."""
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return CheckpointError(
        f"{entry} is {kind}, not {want}: fzero reads and writes only regular files and directories inside a "
        "checkpoint directory (it never follows a link out of it, never opens a pipe or a device); remove it, or "
        "restore the checkpoint from a copy"
    )


def check_entry(entry: str, *, directory: bool = False) -> bool:
    """Whether ``entry`` exists (not following a symlink): ``True`` for a regular file (a real
    directory with ``directory``), ``False`` if there is nothing; else ``CheckpointError``."""
    try:
        mode = os.lstat(entry).st_mode
    except FileNotFoundError:
        return False
    if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        raise refuse(entry, mode, "a snapshot directory" if directory else "a regular file")
    return True


def open_regular(file: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A file descriptor of the regular file ``file``, opened with ``flags`` plus ``O_NOFOLLOW |
    O_NONBLOCK | O_CLOEXEC``: ``CheckpointError`` for a symlink, a FIFO, a device, a directory
    (a FIFO is refused without blocking); ``FileNotFoundError`` if there is none."""
    try:
        fd = os.open(file, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:  # ELOOP: a symlink; EISDIR: a directory; ENXIO: a socket
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV):
            raise refuse(file, os.lstat(file).st_mode) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise refuse(file, st.st_mode)
    return fd


def read_file(file: str) -> bytes:
    """The bytes of the regular file ``file`` (see :func:`open_regular`)."""
    with os.fdopen(open_regular(file), "rb") as f:
        return f.read()


def regular_size(file: str) -> int:
    """The size of the regular file ``file`` (``CheckpointError`` for anything else,
    ``FileNotFoundError`` if there is none)."""
    st = os.lstat(file)
    if not stat.S_ISREG(st.st_mode):
        raise refuse(file, st.st_mode)
    return st.st_size


def create(file: str) -> int:
    """A write descriptor of a new, empty regular file ``file``: ``CheckpointError`` if
    anything is there already (a symlink included: it is not followed)."""
    try:
        return os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        raise CheckpointError(f"cannot create {file}: something is there already (fzero creates only new files "
                              "with names of its own)") from None


def write_new(file: str, data: bytes) -> None:
    """Create ``file`` (:func:`create`) holding ``data``, fsynced."""
    with os.fdopen(create(file), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
