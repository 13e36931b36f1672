"""Reading a snapshot at any world size: which old files hold this rank's elements, and where.

**Global coordinates.** Every ``[S]`` leaf of the optimizer state (FP32 master, Adam moments,
bool masks) is a slice of one virtual ``[P]`` vector: the params' leaves concatenated in tree
order, *without* padding. Rank ``r``'s file holds, under the state leaf's path as key
(``"master"``, ``"tx_state/0/mu"``, ``"tx_state/1/mask"`` for ``adamw`` with a decay mask), the
real elements of its shard in increasing global order (``Layout.owned(r)``); the manifest lists
which global ranges (``segments``) each file holds. Padding is never stored, so nothing in a
checkpoint depends on the world size, the alignment or the bucketing it was saved with: a load
at any world size (and any ``alignment``/``bucket_bytes``) maps the new rank's shard to global
ranges and reads, from each old file that overlaps them (:func:`_overlaps`), only those element
ranges (``safe_open(...).get_slice(key)[a:b]`` on a memory map). Padding comes back as zeros,
which is what the step keeps it at (zero grads, zero weights, zero moments). Integrity: with
``load(verify=True)`` (the default) each file is also hashed in full, once, by the new rank
that reads most of it (:func:`_verifiers`; so the whole checkpoint is read once more in total,
spread over the ranks); ``verify=False`` reads only the ranges.

**A load reads one snapshot.** Rank 0 reads the pointer once; every rank receives the snapshot
name and manifest sha256 from it, reads that snapshot's manifest and checks its sha256 against
the pointer's. As snapshots are immutable and names unique, everything a load returns comes
from one save. A save that commits during a load keeps the loaded snapshot; a second one
deletes it, and a load still reading it then raises ``CheckpointError`` ("replaced while
loading"; load again) -- never data of two saves.

**The optimizer's configuration on load.** The 0-d state leaves named in a state NamedTuple's
``HYPERPARAMS`` (``lr``, ``b1``, ``b2``, ``eps``, ``weight_decay``, ``max_norm``, ...; see
``transforms.iter_hyperparams``) and the per-leaf masks (``MaskedState.mask``: ``adamw``'s and
``sgd``'s ``weight_decay_mask``, ``masked``) are the engine's own by default, and every one that
differs from the checkpoint's is reported (a mask leaf by leaf: :func:`_mask_counts`);
``hyperparams="checkpoint"`` restores the saved ones. Everything else (counts, moments, master)
always comes from the checkpoint.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
from typing import Any, NamedTuple

import torch

from transforms import iter_hyperparams, with_host_value
from transforms.base import MaskedState, _named_tuples

from ..engine import ZeroState
from ..flat import Layout, leaf_paths
from ..scaler import DynamicLossScale, LossScaleState
from .commit import POINTER, _read_pointer, _sha256
from .manifest import MANIFEST, _classify, _validate_manifest
from .strict_json import CheckpointError, _dtype_name, _Fields, _from_json_value, _parse_json

try:  # a declared dependency; guarded so that ``import fzero`` works without it
    from safetensors import safe_open
except ImportError:  # pragma: no cover
    safe_open = None


class _Template(NamedTuple):
    """A fresh state of the engine, flattened: what ``load`` fills."""

    state: ZeroState
    scaler: LossScaleState
    names: list
    leaves: list
    spec: Any
    kinds: list


def _vanished(path: str, snapshot: str, file: str, what: str) -> CheckpointError:
    """The error for ``file`` of ``snapshot`` that is not there: a later save deleted the
    snapshot (the pointer has moved on), or the checkpoint is damaged."""
    try:
        now = _read_pointer(path)[0]
    except (OSError, CheckpointError):
        now = None
    if now != snapshot:
        return CheckpointError(
            f"checkpoint {path} was replaced while loading: {file} is gone and {POINTER} now names {now} "
            "(each save deletes the snapshots before the previous one); load again"
        )
    return CheckpointError(f"{what} {file} is missing")


def _read_snapshot_manifest(path: str, snapshot: str, digest: str) -> dict:
    """The manifest of ``snapshot``, checked against the pointer's sha256, then validated."""
    file = os.path.join(path, snapshot, MANIFEST)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise _vanished(path, snapshot, file, "manifest") from None
    sha = hashlib.sha256(data).hexdigest()
    if sha != digest:
        raise CheckpointError(f"{file} is corrupted: sha256 {sha} but {os.path.join(path, POINTER)} says {digest}")
    return _validate_manifest(_parse_json(data, file), file)


# ---------------------------------------------------------------------------------- does it fit this engine
def _check_loss_scale(manifest: dict, engine, file: str) -> None:
    """What only this engine can judge: its dynamic loss scale's range."""
    policy, scale = engine.loss_scale, manifest["loss_scale"]["scale"]
    if isinstance(policy, DynamicLossScale) and not policy.min_scale <= scale <= policy.max_scale:
        _Fields(file).fail(
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
            raise CheckpointError(f"{where}: leaf {p!r} has shape {shape} in the checkpoint but {have[p]} in this model")
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
    have = {n: (k, _dtype_name(l.dtype)) for n, l, k in zip(names, leaves, kinds)}
    saved_names = [e["name"] for e in saved]
    for e in saved:
        if e["name"] not in have:
            raise CheckpointError(
                f"{where}: state leaf {e['name']!r} ({e['kind']}, {e['dtype']}) is not in this engine's optimizer "
                f"state (a different transform?); this engine has {names}"
            )
        kind, dtype = have[e["name"]]
        if (e["kind"], e["dtype"]) != (kind, dtype):
            raise CheckpointError(
                f"{where}: state leaf {e['name']!r} is {e['kind']} {e['dtype']} in the checkpoint but {kind} {dtype} here"
            )
    for name in names:
        if name not in saved_names:
            raise CheckpointError(f"{where}: this engine's state leaf {name!r} is not in the checkpoint (a different transform?)")


def _check_shard(file: str, entry: dict, *, sha256: bool) -> None:
    """The shard file has the size (and, with ``sha256``, the checksum) its manifest entry
    records; ``FileNotFoundError`` if it is missing (the caller says why it may be)."""
    size = os.path.getsize(file)
    if size != entry["bytes"]:
        raise CheckpointError(f"shard file {file} has {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)")
    if sha256:
        sha, _ = _sha256(file)
        if sha != entry["sha256"]:
            raise CheckpointError(f"shard file {file} is corrupted: sha256 {sha} but the manifest says {entry['sha256']}")


def _check_files(manifest: dict, path: str, snapshot: str) -> None:
    """Every listed file exists with its recorded size (their ranges were validated)."""
    for entry in manifest["files"]:
        file = os.path.join(path, snapshot, entry["file"])
        try:
            _check_shard(file, entry, sha256=False)
        except FileNotFoundError:
            raise _vanished(path, snapshot, file, "shard file") from None


def _verify_snapshot(path: str, snapshot: str) -> str:
    """The snapshot in full, without a pointer (``recover``): its manifest is valid and every
    shard file has its recorded size and sha256. Returns the manifest's sha256."""
    file = os.path.join(path, snapshot, MANIFEST)
    try:
        with open(file, "rb") as f:
            data = f.read()
        manifest = _validate_manifest(_parse_json(data, file), file)
        for entry in manifest["files"]:
            shard = os.path.join(path, snapshot, entry["file"])
            _check_shard(shard, entry, sha256=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"{e.filename} is missing") from None
    return hashlib.sha256(data).hexdigest()


def _open_snapshot(path: str, snapshot: str, digest: str, engine, layout: Layout) -> tuple[dict, _Template]:
    """Every rank: the snapshot's manifest, checked against this engine; the state to fill."""
    manifest = _read_snapshot_manifest(path, snapshot, digest)
    where = os.path.join(path, snapshot, MANIFEST)
    state, scaler = engine.state_like()
    names, leaves, spec = leaf_paths(state)
    template = _Template(state, scaler, names, leaves, spec, _classify(names, leaves, layout.shard_numel))
    _check_loss_scale(manifest, engine, where)
    _check_model(manifest, layout, where)
    _check_state(manifest, names, leaves, template.kinds, where)
    _check_files(manifest, path, snapshot)
    return manifest, template


# ---------------------------------------------------------------------------------- the reading plan
def _overlaps(old_segments, new_segments):
    """``(file_pos, shard_pos, length)`` for each overlap of a file's global ranges (stored
    back to back in the file) with a rank's sorted ``(g0, g1, pos)`` ranges."""
    out, fpos, j = [], 0, 0
    for h0, h1 in old_segments:
        while j < len(new_segments) and new_segments[j][1] <= h0:
            j += 1
        k = j
        while k < len(new_segments) and new_segments[k][0] < h1:
            g0, g1, pos = new_segments[k]
            s, e = max(h0, g0), min(h1, g1)
            if s < e:
                out.append((fpos + s - h0, pos + s - g0, e - s))
            k += 1
        fpos += h1 - h0
    return out


def _verifiers(files: list, new_segments: list) -> list[int]:
    """For each old file, the new rank that hashes it: the one that reads most of it (so the
    page cache serves its reads), else round robin for files with no real elements.
    ``new_segments[r]``: rank ``r``'s ``Layout.owned`` ranges."""
    flat = sorted((g0, g1, r) for r, segs in enumerate(new_segments) for g0, g1, _ in segs)
    starts = [g0 for g0, _, _ in flat]
    n = len(new_segments)
    out = []
    for j, entry in enumerate(files):
        seen: dict[int, int] = {}
        for h0, h1 in entry["segments"]:
            k = max(bisect.bisect_right(starts, h0) - 1, 0)
            while k < len(flat) and flat[k][0] < h1:
                g0, g1, r = flat[k]
                m = min(h1, g1) - max(h0, g0)
                if m > 0:
                    seen[r] = seen.get(r, 0) + m
                k += 1
        out.append(min(seen, key=lambda r: (-seen[r], r)) if seen else j % n)
    return out


def _check_sums(path: str, snapshot: str, files: list, new_segments: list, rank: int) -> None:
    """The files this rank hashes (``_verifiers``) match the manifest's sha256."""
    for entry, owner in zip(files, _verifiers(files, new_segments)):
        if owner != rank:
            continue
        file = os.path.join(path, snapshot, entry["file"])
        try:
            _check_shard(file, entry, sha256=True)
        except FileNotFoundError:
            raise _vanished(path, snapshot, file, "shard file") from None


# ---------------------------------------------------------------------------------- reading
def _restore_scaler(saved: dict, fresh: LossScaleState, engine) -> LossScaleState:
    """The saved loss-scale state, field by field; fields the checkpoint lacks keep the fresh
    value. A static (or no) loss scale is configuration, not state: its scale stays the
    engine's, so resuming FP16 with dynamic scaling as BF16 without scaling works."""
    dynamic = isinstance(engine.loss_scale, DynamicLossScale)
    fields = {}
    for name, old in zip(type(fresh)._fields, fresh):
        keep = name not in saved or (name == "scale" and not dynamic)
        fields[name] = old if keep else _from_json_value(saved[name], old.dtype, old.device)
    return type(fresh)(**fields)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    x, y = a.item(), b.item()
    return x == y or (x != x and y != y)  # nan == nan here


def _first_leaves(manifest: dict, t: _Template, hyperparams: str) -> tuple[list, list, dict]:
    """The 0-d leaves (hyperparameters from the engine or the checkpoint, the rest from the
    checkpoint) and zeroed ``[S]`` buffers to read into; ``[(name, saved, engine)]`` for every
    hyperparameter whose values differ; ``{index: the engine's mask}`` for each mask leaf."""
    saved = {e["name"]: e for e in manifest["state"]}
    hyper = {id(leaf) for _, leaf in iter_hyperparams(t.state)}
    masks = {id(node.mask) for node in _named_tuples(t.state) if isinstance(node, MaskedState)}
    out, differ, engine_masks, seen = [], [], {}, set()
    for i, (name, leaf, kind) in enumerate(zip(t.names, t.leaves, t.kinds)):
        if kind == "shard":  # fill the template's own buffers (no second copy of the state), padding zero
            if id(leaf) in masks:
                engine_masks[i] = leaf.detach().clone()
            if leaf.untyped_storage().data_ptr() in seen:
                leaf = torch.empty_like(leaf)
            seen.add(leaf.untyped_storage().data_ptr())
            out.append(leaf.detach().zero_())
            continue
        value = _from_json_value(saved[name]["value"], leaf.dtype, leaf.device)
        if id(leaf) in hyper:
            value = with_host_value(value, float(saved[name]["value"]))  # for fused kernels (no device read)
            if not _same(value, leaf):
                differ.append((name, value.item(), leaf.item()))
            if hyperparams == "engine":
                value = leaf
        out.append(value)
    return out, differ, engine_masks


def _mask_counts(t: _Template, out: list, engine_masks: dict, owned, layout: Layout) -> dict:
    """For each mask leaf and each params leaf, over this rank's real elements: ``[True in the
    checkpoint's, True in the engine's, elements where they differ, elements]``, keyed by
    ``(state leaf name, params leaf path)`` (summed over ranks, it says which leaves differ)."""
    starts, sizes = layout.global_offsets, [math.prod(s) for s in layout.shapes]
    counts = {}
    for i, mine in engine_masks.items():
        for g0, g1, pos in owned:
            k = bisect.bisect_right(starts, g0) - 1  # the leaf holding global element g0
            while g0 < g1:
                end = min(g1, starts[k] + sizes[k])
                a, b = out[i][pos : pos + end - g0], mine[pos : pos + end - g0]
                c = counts.setdefault((t.names[i], layout.paths[k]), [0, 0, 0, 0])
                for j, n in enumerate((int(a.sum()), int(b.sum()), int((a != b).sum()), end - g0)):
                    c[j] += n
                pos, g0, k = pos + end - g0, end, k + 1
    return counts


def _mask_differences(counts_by_rank: list) -> list[str]:
    """One item per (mask, params leaf) that differs, from every rank's ``_mask_counts``."""
    total = {}
    for counts in counts_by_rank:
        for key, c in counts.items():
            total[key] = [x + y for x, y in zip(total.get(key, [0, 0, 0, 0]), c)]
    items = []
    for (name, leaf), (saved, mine, differ, n) in total.items():
        if not differ:
            continue
        if saved in (0, n) and mine in (0, n):
            items.append(f"{name}[{leaf}]: checkpoint {saved == n}, engine {mine == n}")
        else:
            items.append(f"{name}[{leaf}]: checkpoint True on {saved} of {n} elements, engine on {mine}")
    return items


def _read_file(path: str, snapshot: str, entry: dict, pieces: list, t: _Template, out: list) -> None:
    """Copy the ``pieces`` of one old shard file into this rank's buffers ``out``."""
    file = os.path.join(path, snapshot, entry["file"])
    length = sum(g1 - g0 for g0, g1 in entry["segments"])
    try:
        f = safe_open(file, framework="pt")
    except Exception as e:  # noqa: BLE001
        if not os.path.exists(file):
            raise _vanished(path, snapshot, file, "shard file") from None
        raise CheckpointError(f"shard file {file} cannot be opened: {e}") from e
    with f:
        meta = f.metadata() or {}
        if json.loads(meta.get("segments", "null")) != entry["segments"]:
            raise CheckpointError(f"shard file {file} does not hold the ranges the manifest lists for it")
        keys = set(f.keys())
        for i, (name, kind) in enumerate(zip(t.names, t.kinds)):
            if kind != "shard":
                continue
            if name not in keys:
                raise CheckpointError(f"shard file {file} has no tensor for state leaf {name!r}")
            sl = f.get_slice(name)
            if sl.get_shape() != [length]:
                raise CheckpointError(f"shard file {file}: state leaf {name!r} has shape {sl.get_shape()}, expected [{length}]")
            for fpos, spos, m in pieces:
                src = sl[fpos : fpos + m]
                if src.dtype != out[i].dtype:
                    raise CheckpointError(f"shard file {file}: state leaf {name!r} is {src.dtype}, expected {out[i].dtype}")
                out[i][spos : spos + m].copy_(src)


def _read_state(path, snapshot, manifest, t: _Template, owned, engine, hyperparams) -> tuple:
    """Every rank: its leaves of the state (``owned``: its ``Layout.owned`` ranges), the
    loss-scale state, the differing hyperparameters, its ``_mask_counts`` (``None`` with
    ``hyperparams="checkpoint"`` or no masks)."""
    out, differ, engine_masks = _first_leaves(manifest, t, hyperparams)
    for entry in manifest["files"]:
        pieces = _overlaps(entry["segments"], owned)
        if pieces:
            _read_file(path, snapshot, entry, pieces, t, out)
    counts = None  # the same on every rank: whether they all take part in gathering the counts
    if hyperparams == "engine" and engine_masks:
        counts = _mask_counts(t, out, engine_masks, owned, engine.layout)
        for i, mine in engine_masks.items():
            out[i].copy_(mine)
    return out, _restore_scaler(manifest["loss_scale"], t.scaler, engine), differ, counts
