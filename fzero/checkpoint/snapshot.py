"""Opening a snapshot for a load: its manifest checked against the pointer, then against this
engine (model, optimizer state, loss scale), its shard files against the manifest.

**A load reads one snapshot.** Rank 0 reads the pointer once; every rank receives the snapshot
name and manifest sha256 from it, reads that snapshot's manifest and checks its sha256 against
the pointer's. As snapshots are immutable and names unique, everything a load returns comes
from one save. A save that commits during a load keeps the loaded snapshot; a second one
deletes it, and a load still reading it then raises ``CheckpointError`` ("replaced while
loading"; load again) -- never data of two saves.

``recover`` checks a snapshot in full without a pointer (:func:`verify_snapshot`).

The snapshot directory must be a real directory and its manifest and shard files regular files,
none of them a symlink (:mod:`fzero.checkpoint.files`): a FIFO in place of one is refused, never
read (a read would block).
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, NamedTuple

from ..engine import ZeroState
from ..layout import Layout
from ..scaler import DynamicLossScale, LossScaleState
from . import files
from .commit import POINTER, read_pointer
from .durable import file_sha256
from .form import converts, saved_form
from .manifest import MANIFEST, state_leaves, validate_manifest
from .strict_json import CheckpointError, Fields, dtype_name, parse_json

__all__ = ["Template", "vanished", "read_snapshot_manifest", "check_shard", "verify_snapshot", "open_snapshot"]


class Template(NamedTuple):
    """A fresh state of the engine in the form a checkpoint holds (``form.saved_form``),
    flattened: what ``load`` fills. ``engine_state``: the fresh state as the engine holds it
    (``form.engine_form`` turns the filled one back)."""

    state: ZeroState
    scaler: LossScaleState
    names: list
    leaves: list
    spec: Any
    kinds: list
    engine_state: ZeroState


def vanished(path: str, snapshot: str, file: str, what: str) -> CheckpointError:
    """The error for ``file`` of ``snapshot`` that is not there: a later save deleted the
    snapshot (the pointer has moved on), or the checkpoint is damaged."""
    try:
        now = read_pointer(path)[0]
    except (OSError, CheckpointError):
        now = None
    if now != snapshot:
        return CheckpointError(
            f"checkpoint {path} was replaced while loading: {file} is gone and {POINTER} now names {now} "
            "(each save deletes the snapshots before the previous one); load again"
        )
    return CheckpointError(f"{what} {file} is missing")


def _read_manifest_bytes(path: str, snapshot: str) -> tuple[str, bytes]:
    """``(file, its bytes)`` of the manifest of ``snapshot``, a real directory in ``path``
    (``FileNotFoundError`` if either is missing)."""
    files.check_entry(os.path.join(path, snapshot), directory=True)
    file = os.path.join(path, snapshot, MANIFEST)
    return file, files.read_file(file)


def read_snapshot_manifest(path: str, snapshot: str, digest: str) -> dict:
    """The manifest of ``snapshot``, checked against the pointer's sha256, then validated."""
    file = os.path.join(path, snapshot, MANIFEST)
    try:
        file, data = _read_manifest_bytes(path, snapshot)
    except FileNotFoundError:
        raise vanished(path, snapshot, file, "manifest") from None
    sha = hashlib.sha256(data).hexdigest()
    if sha != digest:
        raise CheckpointError(f"{file} is corrupted: sha256 {sha} but {os.path.join(path, POINTER)} says {digest}")
    return validate_manifest(parse_json(data, file), file)


# ---------------------------------------------------------------------------------- does it fit this engine
def _check_loss_scale(manifest: dict, engine, file: str) -> None:
    """What only this engine can judge: its dynamic loss scale's range."""
    policy, scale = engine.loss_scale, manifest["loss_scale"]["scale"]
    if isinstance(policy, DynamicLossScale) and not policy.min_scale <= scale <= policy.max_scale:
        Fields(file).fail(
            "loss_scale.scale", scale,
            f"must be in [min_scale, max_scale] = [{policy.min_scale}, {policy.max_scale}] of this engine's DynamicLossScale",
        )


def _check_model(manifest: dict, layout: Layout, where: str) -> None:
    saved = manifest["layout"]["leaves"]
    have = {p: tuple(s) for p, s in zip(layout.paths, layout.shapes)}
    for entry in saved:
        p, shape = entry["path"], tuple(entry["shape"])
        if p not in have:
            raise CheckpointError(f"{where}: checkpoint leaf {p!r} (shape {shape}) is not in this model")
        if have[p] != shape:
            # e.g. a matrix saved [in, out] by a model that now stores it [out, in]
            turned = " (transposed)" if have[p] == shape[::-1] else ""
            raise CheckpointError(f"{where}: leaf {p!r} has shape {shape} in the checkpoint but {have[p]}{turned} "
                                  "in this model")
    names = [e["path"] for e in saved]
    for p in layout.paths:
        if p not in names:
            raise CheckpointError(f"{where}: model leaf {p!r} (shape {have[p]}) is not in the checkpoint")
    if names != list(layout.paths):
        raise CheckpointError(f"{where}: the checkpoint orders the leaves differently from this model")
    if manifest["layout"]["numel"] != layout.numel:
        raise CheckpointError(f"{where}: checkpoint has {manifest['layout']['numel']} elements, model {layout.numel}")


def _check_state(manifest: dict, names, leaves, kinds, where: str) -> None:
    saved = manifest["state"]
    have = {n: (k, dtype_name(l.dtype)) for n, l, k in zip(names, leaves, kinds)}
    shapes = {n: list(leaf.shape) for n, leaf in zip(names, leaves)}
    saved_names = [e["name"] for e in saved]
    for e in saved:
        if e["name"] not in have:
            raise CheckpointError(
                f"{where}: state leaf {e['name']!r} ({e['kind']}, {e['dtype']}) is not in this engine's optimizer "
                f"state (a different transform?); this engine has {names}"
            )
        kind, dtype = have[e["name"]]
        if e["kind"] != kind or not (e["dtype"] == dtype or kind == "shard" and converts(e["dtype"], dtype)):
            raise CheckpointError(
                f"{where}: state leaf {e['name']!r} is {e['kind']} {e['dtype']} in the checkpoint but {kind} {dtype} here"
            )
        if kind == "replicated" and e["shape"] != shapes[e["name"]]:
            raise CheckpointError(f"{where}: state leaf {e['name']!r} has shape {e['shape']} in the checkpoint but "
                                  f"{shapes[e['name']]} here")
    for name in names:
        if name not in saved_names:
            raise CheckpointError(f"{where}: this engine's state leaf {name!r} is not in the checkpoint (a different transform?)")


def check_shard(file: str, entry: dict, *, sha256: bool) -> None:
    """The shard file has the size (and, with ``sha256``, the checksum) its manifest entry
    records; ``FileNotFoundError`` if it is missing (the caller says why it may be);
    ``CheckpointError`` if it is not a regular file."""
    size = files.regular_size(file)
    if size != entry["bytes"]:
        raise CheckpointError(f"shard file {file} has {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)")
    if sha256:
        sha, _ = file_sha256(file)
        if sha != entry["sha256"]:
            raise CheckpointError(f"shard file {file} is corrupted: sha256 {sha} but the manifest says {entry['sha256']}")


def _check_files(manifest: dict, path: str, snapshot: str) -> None:
    """Every listed file exists with its recorded size (their ranges were validated)."""
    for entry in manifest["files"]:
        file = os.path.join(path, snapshot, entry["file"])
        try:
            check_shard(file, entry, sha256=False)
        except FileNotFoundError:
            raise vanished(path, snapshot, file, "shard file") from None


def verify_snapshot(path: str, snapshot: str) -> str:
    """The snapshot in full, without a pointer (``recover``): its manifest is valid and every
    shard file has its recorded size and sha256. Returns the manifest's sha256."""
    try:
        file, data = _read_manifest_bytes(path, snapshot)
        manifest = validate_manifest(parse_json(data, file), file)
        for entry in manifest["files"]:
            shard = os.path.join(path, snapshot, entry["file"])
            check_shard(shard, entry, sha256=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"{e.filename} is missing") from None
    return hashlib.sha256(data).hexdigest()


def open_snapshot(path: str, snapshot: str, digest: str, engine, layout: Layout) -> tuple[dict, Template]:
    """Every rank: the snapshot's manifest, checked against this engine; the state to fill."""
    manifest = read_snapshot_manifest(path, snapshot, digest)
    where = os.path.join(path, snapshot, MANIFEST)
    engine_state, scaler = engine.state_like()
    state = saved_form(engine_state, engine.shard_context)
    names, leaves, spec, kinds = state_leaves(state, layout.shard_numel)
    template = Template(state, scaler, names, leaves, spec, kinds, engine_state)
    _check_loss_scale(manifest, engine, where)
    _check_model(manifest, layout, where)
    _check_state(manifest, names, leaves, template.kinds, where)
    _check_files(manifest, path, snapshot)
    return manifest, template
