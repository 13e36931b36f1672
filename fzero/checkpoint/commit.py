"""The commit protocol: a checkpoint is a directory of immutable snapshots and a pointer.

::

    path/fzero-checkpoint.json                            marker: the snapshots fzero created here
    path/current.json                                     pointer: current snapshot + its manifest's sha256
    path/snapshot-<32 hex>/manifest.json                  written by rank 0, last
    path/snapshot-<32 hex>/shard-00000-of-00002.safetensors   written by rank 0
    path/snapshot-<32 hex>/shard-00001-of-00002.safetensors   written by rank 1

A snapshot directory is written once, by one save, and never modified; its name
``snapshot-<uuid4 hex>`` is never reused. ``save``:

1. rank 0 creates ``path`` if needed (an existing non-empty directory without the marker is not
   fzero's: refused), records the new snapshot's name in the marker, then creates the snapshot
   directory (so every snapshot fzero creates is recorded before it exists);
2. every rank writes and fsyncs its shard file in it and reports the file's sha256;
3. rank 0 writes and fsyncs ``manifest.json`` (after validating it as ``load`` will);
4. rank 0 commits: writes ``.current.json.tmp-<id>``, fsyncs it, ``os.replace``s it onto
   ``current.json`` and fsyncs ``path``. The replace is the commit point;
5. rank 0 deletes every snapshot the marker records except the new one and the one the pointer
   named before this save (kept until the next save, so a load that resolved the pointer just
   before this save still finds its files), then rewrites the marker.

The marker and the pointer are always rewritten the same way (temporary file, fsync, atomic
replace). A crash before the replace of step 4 (a rank killed mid-write included) leaves the
pointer, and the snapshot it names, untouched: the previous checkpoint loads; the partial
snapshot is recorded in the marker and deleted by the next save, as are leftover
``.current.json.tmp-*``/``.fzero-checkpoint.json.tmp-*`` files (names fzero reserves). A crash
after it leaves the new checkpoint committed; its cleanup is done by the next save. A save
deletes nothing else: no sibling of ``path``, no file or directory in ``path`` that the marker
does not record. A symlink at ``path`` stays; the checkpoint is written into its target.
Concurrent saves to one path are not supported (one writer, any number of readers). ``path``
must be on a filesystem that every rank sees (a shared filesystem on several nodes).

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

from ..flat import concat
from .manifest import FORMAT, MANIFEST, _SHA256, _validate_manifest
from .strict_json import VERSION, CheckpointError, _check_header, _dump_json, _Fields, _parse_json

try:  # a declared dependency; guarded so that ``import fzero`` works without it
    from safetensors.torch import save_file
except ImportError:  # pragma: no cover
    save_file = None

POINTER = "current.json"
MARKER = "fzero-checkpoint.json"
MARKER_FORMAT = "fzero-checkpoint-directory"

_SNAPSHOT = re.compile(r"snapshot-[0-9a-f]{32}")
_OWN_TMP = re.compile(r"\.(%s|%s)\.tmp-[0-9a-f]{12}" % (re.escape(POINTER), re.escape(MARKER)))


def _no_hook(point: str, **info) -> None:
    """The default ``_hook``: does nothing."""


def _need_safetensors() -> None:
    if save_file is None:
        raise ImportError("fzero.checkpoint needs the safetensors package: pip install safetensors")


# ---------------------------------------------------------------------------------- files
def _fsync_dir(path: str) -> None:
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


def _sha256(path: str, *, fsync: bool = False) -> tuple[str, int]:
    """``(sha256 hex, size)`` of the file; with ``fsync``, fsynced first."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        if fsync:
            os.fsync(f.fileno())
        while chunk := f.read(1 << 24):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _write_synced(file: str, data: bytes) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(directory: str, name: str, data: bytes, hook: Callable = _no_hook, point: str | None = None) -> None:
    """Replace ``directory/name`` by ``data`` atomically: write ``.<name>.tmp-<id>``, fsync it,
    ``os.replace`` it onto ``name``, fsync the directory."""
    tmp = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        _write_synced(tmp, data)
        if point is not None:
            hook(point, file=tmp)
        os.replace(tmp, os.path.join(directory, name))
    except Exception:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


# ---------------------------------------------------------------------------------- pointer and marker
def _read_small_json(file: str, kind: str, format: str) -> tuple[dict, _Fields]:
    with open(file, "rb") as f:
        obj = _parse_json(f.read(), file)
    return obj, _check_header(obj, file, kind, format)


def _read_pointer(path: str) -> tuple[str, str]:
    """``(snapshot name, sha256 of its manifest)`` from ``path/current.json``."""
    p, c = _read_small_json(os.path.join(path, POINTER), "pointer", FORMAT)
    snapshot = c.string("snapshot", c.get(p, "snapshot"), _SNAPSHOT)
    return snapshot, c.string("manifest_sha256", c.get(p, "manifest_sha256"), _SHA256)


def _write_pointer(path: str, snapshot: str, digest: str, hook: Callable) -> None:
    data = _dump_json({"format": FORMAT, "version": VERSION, "snapshot": snapshot, "manifest_sha256": digest})
    _write_atomic(path, POINTER, data, hook, "pointer_written")


def _read_marker(path: str) -> list[str]:
    """The snapshot names fzero recorded in ``path/fzero-checkpoint.json``."""
    m, c = _read_small_json(os.path.join(path, MARKER), "marker", MARKER_FORMAT)
    names = c.sequence("snapshots", c.get(m, "snapshots"))
    return [c.string(f"snapshots[{i}]", name, _SNAPSHOT) for i, name in enumerate(names)]


def _write_marker(path: str, snapshots: list[str]) -> None:
    _write_atomic(path, MARKER, _dump_json({"format": MARKER_FORMAT, "version": VERSION, "snapshots": snapshots}))


def _resolve(path: str) -> tuple[str, str]:
    """``(snapshot, manifest sha256)`` that the checkpoint at ``path`` currently points to."""
    if not os.path.lexists(path):
        raise CheckpointError(f"no checkpoint at {path}: it does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}: it is not a directory")
    try:
        return _read_pointer(path)
    except FileNotFoundError:
        pass
    if os.path.isfile(os.path.join(path, MANIFEST)):
        raise CheckpointError(f"{path} is a checkpoint of format version 1 (a {MANIFEST}, no {POINTER}); "
                              f"this fzero reads version {VERSION}")
    if os.path.isfile(os.path.join(path, MARKER)):
        raise CheckpointError(f"no checkpoint at {path}: no save to it has completed ({POINTER} is missing)")
    raise CheckpointError(f"no checkpoint at {path}: {os.path.join(path, POINTER)} is missing")


# ---------------------------------------------------------------------------------- save steps
def _open_dir(path: str) -> list[str]:
    """Rank 0: ``path`` as an fzero checkpoint directory (created, or its symlink's target
    created, if missing); the snapshot names its marker records."""
    if not os.path.exists(path):  # missing, or a symlink to a missing directory
        os.makedirs(os.path.realpath(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"refusing to overwrite {path}: it exists and is not a directory")
    if os.path.isfile(os.path.join(path, MARKER)):
        return _read_marker(path)
    if os.listdir(path):
        raise CheckpointError(f"refusing to overwrite {path}: it exists, is not empty and is not an fzero "
                              f"checkpoint directory of format version {VERSION} (no {MARKER})")
    return []


def _begin(path: str, hook: Callable) -> str:
    """Rank 0, step 1: a new snapshot name, recorded in the marker, then its directory."""
    recorded = _open_dir(path)
    for name in os.listdir(path):  # temporary files of an interrupted save (names fzero reserves)
        if _OWN_TMP.fullmatch(name):
            os.remove(os.path.join(path, name))
    snapshot = f"snapshot-{uuid.uuid4().hex}"
    _write_marker(path, recorded + [snapshot])
    os.mkdir(os.path.join(path, snapshot))
    _fsync_dir(path)
    hook("snapshot_created", dir=os.path.join(path, snapshot))
    return snapshot


def _write_shard(directory, rank, world_size, names, leaves, kinds, owned, hook: Callable) -> dict:
    """Step 2, every rank: its shard file in the snapshot directory; its manifest entry.

    ``owned``: the rank's ``Layout.owned`` ranges; each ``[S]`` leaf is stored as the real
    elements of those ranges, back to back (no padding)."""
    _need_safetensors()
    fname = f"shard-{rank:05d}-of-{world_size:05d}.safetensors"
    file = os.path.join(directory, fname)
    segments = [[g0, g1] for g0, g1, _ in owned]
    tensors = {}
    for name, leaf, kind in zip(names, leaves, kinds):
        if kind == "shard":
            parts = [leaf.detach()[p : p + g1 - g0] for g0, g1, p in owned]
            tensors[name] = (concat(parts) if parts else leaf.new_empty(0)).to("cpu").contiguous()
    meta = {"format": FORMAT, "version": str(VERSION), "rank": str(rank), "world_size": str(world_size),
            "segments": json.dumps(segments)}
    save_file(tensors, file, metadata=meta)
    hook("shard_written", file=file, rank=rank)
    sha, size = _sha256(file, fsync=True)
    _fsync_dir(directory)
    return {"file": fname, "rank": rank, "segments": segments, "bytes": size, "sha256": sha}


def _write_manifest(directory: str, manifest: dict, hook: Callable) -> str:
    """Step 3, rank 0: validate the manifest as ``load`` will, write and fsync it; its sha256."""
    file = os.path.join(directory, MANIFEST)
    data = _dump_json(manifest)
    _validate_manifest(_parse_json(data, file), file)
    _write_synced(file, data)
    _fsync_dir(directory)
    hook("manifest_written", file=file)
    return hashlib.sha256(data).hexdigest()


def _commit(path: str, snapshot: str, digest: str, hook: Callable) -> None:
    """Steps 4 and 5, rank 0: point ``current.json`` at ``snapshot``, then clean up."""
    try:
        previous = _read_pointer(path)[0]
    except (OSError, CheckpointError):
        previous = None  # the first save, or an unreadable pointer (replaced now)
    _write_pointer(path, snapshot, digest, hook)
    hook("committed", snapshot=snapshot)
    _cleanup(path, keep={snapshot, previous})


def _cleanup(path: str, keep: set) -> None:
    """Delete the snapshots the marker records except ``keep``; then record what is left.
    Best effort: the save is committed already, and the next save tries again."""
    try:
        recorded = _read_marker(path)
        for name in recorded:
            if name not in keep:
                shutil.rmtree(os.path.join(path, name), ignore_errors=True)
        _write_marker(path, [name for name in recorded if os.path.lexists(os.path.join(path, name))])
    except (OSError, CheckpointError) as e:
        warnings.warn(f"save {path}: committed, but old snapshots were not all removed ({e}); the next save retries")
