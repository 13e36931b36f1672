"""Durable files of a checkpoint: written, fsynced and replaced atomically, and their sha256.

Every file is opened as a regular file, never through a symlink (``fzero.checkpoint.files``).
"""
from __future__ import annotations

import hashlib
import os
import uuid
from typing import Callable

from . import files

__all__ = ["fsync_dir", "file_sha256", "write_atomic"]


def fsync_dir(path: str) -> None:
    """fsync the directory ``path`` (so a rename or a new file in it is durable); best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_sha256(path: str, *, fsync: bool = False) -> tuple[str, int]:
    """``(sha256 hex, size)`` of the regular file ``path`` (not a symlink:
    :func:`fzero.checkpoint.files.open_regular`); with ``fsync``, fsynced first."""
    h = hashlib.sha256()
    size = 0
    with os.fdopen(files.open_regular(path), "rb") as f:
        if fsync:
            os.fsync(f.fileno())
        while chunk := f.read(1 << 24):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def write_atomic(directory: str, name: str, data: bytes, hook: Callable | None = None, point: str | None = None) -> None:
    """Replace ``directory/name`` (a regular file, or nothing) by ``data`` atomically: create
    ``.<name>.tmp-<id>``, fsync it, ``os.replace`` it onto ``name``, fsync the directory.
    ``hook(point, file=the temporary file)`` is called once it is written (a test's crash point)."""
    tmp, file = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}"), os.path.join(directory, name)
    try:
        files.write_new(tmp, data)
        if hook is not None:
            hook(point, file=tmp)
        files.check_entry(file)  # checked before any change too; again here, at the replace
        os.replace(tmp, file)
    except Exception:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(directory)
