"""The commit protocol: a checkpoint is a directory of immutable snapshots and a pointer.

::

    path/fzero-checkpoint.json                            marker: the snapshots fzero created here
    path/current.json                                     pointer: current snapshot + its manifest's sha256
    path/.fzero-checkpoint.lock                           the save lock (an empty file, flock-ed)
    path/snapshot-<32 hex>/manifest.json                  written by rank 0, last
    path/snapshot-<32 hex>/shard-00000-of-00002.safetensors   written by rank 0
    path/snapshot-<32 hex>/shard-00001-of-00002.safetensors   written by rank 1

A snapshot directory is written once, by one save, and never modified; its name
``snapshot-<uuid4 hex>`` is never reused. ``save``:

1. rank 0 creates ``path`` if needed (an existing non-empty directory without the marker is not
   fzero's: refused), takes the save lock, records the new snapshot's name in the
   marker, then creates the snapshot directory (so every snapshot fzero creates is recorded
   before it exists);
2. every rank writes and fsyncs its shard file in it and reports the file's sha256;
3. rank 0 writes and fsyncs ``manifest.json`` (after validating it as ``load`` will);
4. rank 0 commits: writes ``.current.json.tmp-<id>``, fsyncs it, ``os.replace``s it onto
   ``current.json`` and fsyncs ``path``. The replace is the commit point;
5. rank 0 deletes every snapshot the marker records except the new one and the one the pointer
   named before this save (kept until the next save, so a load that resolved the pointer just
   before this save still finds its files), then rewrites the marker, and releases the lock.

The marker and the pointer are always rewritten the same way (temporary file, fsync, atomic
replace). A crash before the replace of step 4 (a rank killed mid-write included) leaves the
pointer, and the snapshot it names, untouched: the previous checkpoint loads; the partial
snapshot is recorded in the marker and deleted by the next save, as are leftover
``.current.json.tmp-*``/``.fzero-checkpoint.json.tmp-*`` files (names fzero reserves). A crash
after it leaves the new checkpoint committed; its cleanup is done by the next save. A save
deletes nothing else: no sibling of ``path``, no file or directory in ``path`` that the marker
does not record. A symlink at ``path`` stays; the checkpoint is written into its target.
``path`` must be on a filesystem that every rank sees (a shared filesystem on several nodes).

**Nothing outside ``path``.** Every entry a save reads, writes, replaces or deletes in ``path`` is
a regular file or (a snapshot) a real directory, never followed if it is a symlink
(:mod:`fzero.checkpoint.files`); the save checks the pointer, the marker, the lock, the
recorded snapshots and its leftover temporary files before it changes anything, and refuses a
symlink, a FIFO, a device or a directory in place of one with ``CheckpointError`` naming it.

**One save at a time.** Rank 0 holds the save lock (:mod:`fzero.checkpoint.lock`) from step 1 to
the end of step 5, so every marker update is made by the one save that holds it, and every
snapshot is recorded before it exists: none is ever left behind unrecorded. Before it commits,
and again before its cleanup, the save checks that the lock file it holds is still the one at
the path (:func:`fzero.checkpoint.lock.check`): if it was removed or replaced, another save may
have run meanwhile and deleted this one's snapshot, so the save fails instead of committing (or,
committed, leaves the cleanup to the next save). Loads take no lock (any number of readers,
racing saves).

**A lost pointer.** If ``current.json`` is missing or unreadable when a save commits, the save
cannot tell which snapshot it named; it keeps every recorded snapshot that holds a
``manifest.json`` (one that never got one was never committed) as this save's previous ones,
and warns, naming them. ``load`` names them too; :func:`fzero.checkpoint.recover` verifies one
and points ``current.json`` at it.

``_hook(point, **info)``: the test hook of ``save``/``load``, called at the protocol points
(``"snapshot_created"``, ``"shard_written"``, ``"manifest_written"``, ``"pointer_written"``,
``"committed"``); tests pass one that kills the process there.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
import warnings
from typing import Callable

from . import files, lock, shard_file
from .durable import fsync_dir, write_atomic
from .lock import LOCK
from .manifest import FORMAT, MANIFEST, SHA256, validate_manifest
from .strict_json import VERSION, CheckpointError, Fields, check_header, dump_json, parse_json

__all__ = [
    "POINTER", "MARKER", "MARKER_FORMAT", "SNAPSHOT", "save_file", "no_hook", "need_safetensors",
    "read_pointer", "write_pointer", "read_marker", "write_marker", "resolve", "complete_snapshots",
    "recorded_snapshots", "check_entries", "remove_snapshot", "begin", "write_shard", "write_manifest", "commit_snapshot",
]

try:  # a declared dependency; guarded so that ``import fzero`` works without it
    from safetensors.torch import save_file
except ImportError:  # pragma: no cover
    save_file = None

POINTER = "current.json"  # names of the pointer and the marker in a checkpoint directory
MARKER = "fzero-checkpoint.json"
MARKER_FORMAT = "fzero-checkpoint-directory"

SNAPSHOT = re.compile(r"snapshot-[0-9a-f]{32}")  # a snapshot directory's name
_OWN_TMP = re.compile(r"\.(%s|%s)\.tmp-[0-9a-f]{12}" % (re.escape(POINTER), re.escape(MARKER)))


def no_hook(point: str, **info) -> None:
    """The default ``_hook``: does nothing."""


def need_safetensors() -> None:
    """``ImportError`` saying how to install safetensors if it is missing."""
    if save_file is None:
        raise ImportError("fzero.checkpoint needs the safetensors package: pip install safetensors")


# ---------------------------------------------------------------------------------- pointer and marker
def _read_small_json(file: str, kind: str, format: str) -> tuple[dict, Fields]:
    obj = parse_json(files.read_file(file), file)
    return obj, check_header(obj, file, kind, format)


def read_pointer(path: str) -> tuple[str, str]:
    """``(snapshot name, sha256 of its manifest)`` from ``path/current.json``."""
    p, c = _read_small_json(os.path.join(path, POINTER), "pointer", FORMAT)
    snapshot = c.string("snapshot", c.get(p, "snapshot"), SNAPSHOT)
    return snapshot, c.string("manifest_sha256", c.get(p, "manifest_sha256"), SHA256)


def write_pointer(path: str, snapshot: str, digest: str, hook: Callable) -> None:
    """Point ``path/current.json`` at ``snapshot`` (its manifest's sha256: ``digest``), atomically."""
    data = dump_json({"format": FORMAT, "version": VERSION, "snapshot": snapshot, "manifest_sha256": digest})
    write_atomic(path, POINTER, data, hook, "pointer_written")


def read_marker(path: str) -> list[str]:
    """The snapshot names fzero recorded in ``path/fzero-checkpoint.json``."""
    m, c = _read_small_json(os.path.join(path, MARKER), "marker", MARKER_FORMAT)
    names = c.sequence("snapshots", c.get(m, "snapshots"))
    return [c.string(f"snapshots[{i}]", name, SNAPSHOT) for i, name in enumerate(names)]


def write_marker(path: str, snapshots: list[str]) -> None:
    """Record ``snapshots`` in ``path/fzero-checkpoint.json``, atomically."""
    write_atomic(path, MARKER, dump_json({"format": MARKER_FORMAT, "version": VERSION, "snapshots": snapshots}))


def resolve(path: str) -> tuple[str, str]:
    """``(snapshot, manifest sha256)`` that the checkpoint at ``path`` currently points to."""
    if not os.path.lexists(path):
        raise CheckpointError(f"no checkpoint at {path}: it does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}: it is not a directory")
    try:
        return read_pointer(path)
    except FileNotFoundError:
        if os.path.isfile(os.path.join(path, MANIFEST)):
            raise CheckpointError(f"{path} is a checkpoint of format version 1 (a {MANIFEST}, no {POINTER}); "
                                  f"this fzero reads version {VERSION}") from None
        if os.path.isfile(os.path.join(path, MARKER)):
            problem = f"no checkpoint at {path}: {POINTER} is missing (no save to it has completed, or it was deleted)"
        else:
            problem = f"no checkpoint at {path}: {os.path.join(path, POINTER)} is missing"
    except (OSError, CheckpointError) as e:
        problem = f"no checkpoint at {path}: {POINTER} is damaged ({e})"
    complete = complete_snapshots(path)
    if not complete:
        raise CheckpointError(f"{problem}; no snapshot in it has a valid {MANIFEST}")
    listed = ", ".join(f"{name} ({'no step' if step is None else f'step {step}'})" for name, step in complete)
    raise CheckpointError(
        f"{problem}; snapshots with a valid {MANIFEST} in it, oldest first: {listed}. "
        f"fzero.checkpoint.recover({path!r}) verifies the newest and points {POINTER} at it "
        f"(recover(path, name) for another one)"
    )


def complete_snapshots(path: str) -> list[tuple[str, int | None]]:
    """``(name, step)`` of every snapshot directory in ``path`` (a real one, not a symlink)
    whose ``manifest.json`` is valid (its shards are not checked), oldest manifest first."""
    found = []
    for name in os.listdir(path):
        file = os.path.join(path, name, MANIFEST)
        if not SNAPSHOT.fullmatch(name):
            continue
        try:
            files.check_entry(os.path.join(path, name), directory=True)
            manifest = validate_manifest(parse_json(files.read_file(file), file), file)
            found.append((os.path.getmtime(file), name, manifest["step"]))
        except (OSError, CheckpointError):
            continue
    return [(name, step) for _, name, step in sorted(found)]


# ---------------------------------------------------------------------------------- save steps
def _ours(name: str) -> bool:
    """A name fzero reserves in a checkpoint directory for its lock and temporary files."""
    return name == LOCK or bool(_OWN_TMP.fullmatch(name))


def check_entries(path: str) -> None:
    """The pointer and the marker of ``path`` are regular files or missing (a save or
    ``recover`` replaces them): ``CheckpointError`` naming the first that is not."""
    for name in (POINTER, MARKER):
        files.check_entry(os.path.join(path, name))


def remove_snapshot(path: str, name: str) -> None:
    """Delete the snapshot directory ``path/name`` and what it holds, if it is a real directory
    (a symlink in its place is left alone: nothing outside ``path`` is deleted)."""
    if files.check_entry(os.path.join(path, name), directory=True):
        shutil.rmtree(os.path.join(path, name), ignore_errors=True)  # never follows a link inside it


def _open_dir(path: str) -> None:
    """Rank 0: check that ``path`` is, or can become, an fzero checkpoint directory (created,
    or its symlink's target created, if missing), before anything is written in it."""
    if not os.path.exists(path):  # missing, or a symlink to a missing directory
        os.makedirs(os.path.realpath(path), exist_ok=True)  # exist_ok: another first save may race this one
    if not os.path.isdir(path):
        raise CheckpointError(f"refusing to overwrite {path}: it exists and is not a directory")
    check_entries(path)
    if not os.path.isfile(os.path.join(path, MARKER)) and not all(_ours(name) for name in os.listdir(path)):
        raise CheckpointError(f"refusing to overwrite {path}: it exists, is not empty and is not an fzero "
                              f"checkpoint directory of format version {VERSION} (no {MARKER})")


def begin(path: str, held: dict, hook: Callable) -> str:
    """Rank 0, step 1: the save lock (into ``held["lock"]``), then a new snapshot name
    (``held["snapshot"]``), recorded in the marker, then its directory."""
    _open_dir(path)
    held["lock"] = lock.acquire(path)
    recorded = read_marker(path) if os.path.isfile(os.path.join(path, MARKER)) else []
    for name in recorded:  # what a cleanup may delete: real directories only (checked before any change)
        files.check_entry(os.path.join(path, name), directory=True)
    leftover = [os.path.join(path, name) for name in os.listdir(path) if _OWN_TMP.fullmatch(name)]
    for file in leftover:  # temporary files of an interrupted save (names fzero reserves)
        files.check_entry(file)
    for file in leftover:
        os.remove(file)
    snapshot = f"snapshot-{uuid.uuid4().hex}"
    write_marker(path, recorded + [snapshot])
    held["snapshot"] = snapshot
    os.mkdir(os.path.join(path, snapshot))
    fsync_dir(path)
    hook("snapshot_created", dir=os.path.join(path, snapshot))
    return snapshot


def write_shard(directory: str, rank: int, world_size: int, contents, hook: Callable) -> dict:
    """Step 2, every rank: its shard file in the snapshot directory (``contents``: the rank's
    :class:`fzero.checkpoint.staging.Contents`, each ``[S]`` leaf's real elements of the ranks'
    owned ranges, back to back, no padding; :mod:`fzero.checkpoint.shard_file`); its manifest entry."""
    fname = f"shard-{rank:05d}-of-{world_size:05d}.safetensors"
    file = os.path.join(directory, fname)
    meta = {"format": FORMAT, "version": str(VERSION), "rank": str(rank), "world_size": str(world_size),
            "segments": json.dumps(contents.segments)}
    parts = (part for e in contents.entries for part in contents.parts[e.name])
    sha, size = shard_file.write(file, shard_file.header(contents.entries, meta), parts)
    hook("shard_written", file=file, rank=rank)
    fsync_dir(directory)
    return {"file": fname, "rank": rank, "segments": contents.segments, "bytes": size, "sha256": sha}


def write_manifest(directory: str, manifest: dict, hook: Callable) -> str:
    """Step 3, rank 0: validate the manifest as ``load`` will, write and fsync it; its sha256."""
    file = os.path.join(directory, MANIFEST)
    data = dump_json(manifest)
    validate_manifest(parse_json(data, file), file)
    files.write_new(file, data)
    fsync_dir(directory)
    hook("manifest_written", file=file)
    return hashlib.sha256(data).hexdigest()


def commit_snapshot(path: str, snapshot: str, digest: str, hook: Callable, lock_fd: int) -> None:
    """Steps 4 and 5, rank 0: point ``current.json`` at ``snapshot``, then clean up; both only
    while ``lock_fd`` (the save lock, :func:`fzero.checkpoint.lock.acquire`) is still on the
    lock file at the path (else ``CheckpointError`` before the commit, a warning after it)."""
    try:
        keep, lost = {snapshot, read_pointer(path)[0]}, None
    except FileNotFoundError:
        lost = f"{POINTER} is missing (no save to {path} has completed, or it was deleted)"
    except (OSError, CheckpointError) as e:
        lost = f"{POINTER} is damaged ({e})"
    if lost is not None:  # any complete snapshot may be the one it named: keep them all
        kept = [name for name in recorded_snapshots(path) if name != snapshot and os.path.isfile(os.path.join(path, name, MANIFEST))]
        keep = {snapshot, *kept}
    lock.check(lock_fd, path)
    write_pointer(path, snapshot, digest, hook)
    hook("committed", snapshot=snapshot)
    try:
        lock.check(lock_fd, path, "after this save committed")
    except CheckpointError as e:
        warnings.warn(f"save {path}: committed, but old snapshots were not removed: {e}; the next save removes them")
        return
    _cleanup(path, keep)
    if lost is not None and kept:
        warnings.warn(
            f"save {path}: {lost}, so this save cannot tell which snapshot was current: it kept {', '.join(kept)} "
            f"(each holds a {MANIFEST}) until the next save; fzero.checkpoint.recover({path!r}, name) points "
            f"{POINTER} back to one"
        )


def recorded_snapshots(path: str) -> list[str]:
    """The marker's snapshots, or none if it cannot be read (then nothing is deleted)."""
    try:
        return read_marker(path)
    except (OSError, CheckpointError):
        return []


def _cleanup(path: str, keep: set) -> None:
    """Delete the snapshots the marker records except ``keep``; then record what is left.
    Best effort: the save is committed already, and the next save tries again."""
    try:
        recorded = read_marker(path)
        for name in recorded:
            if name not in keep:
                remove_snapshot(path, name)
        write_marker(path, [name for name in recorded if os.path.lexists(os.path.join(path, name))])
    except (OSError, CheckpointError) as e:
        warnings.warn(f"save {path}: committed, but old snapshots were not all removed ({e}); the next save retries")
