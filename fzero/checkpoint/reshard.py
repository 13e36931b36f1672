"""Reading a snapshot at any world size: which old files hold this rank's elements, and where.

**Global coordinates.** Every ``[S]`` leaf of the optimizer state (FP32 master, Adam moments,
bool masks) is a slice of one virtual ``[P]`` vector: the params' leaves concatenated in tree
order, *without* padding. Rank ``r``'s file holds, under the state leaf's path as key
(``"master"``, ``"tx_state/0/mu"``, ``"tx_state/1/mask"`` for ``adamw`` with a decay mask), the
real elements of its shard in increasing global order (``Layout.owned(r)``); the manifest lists
which global ranges (``segments``) each file holds. Padding is never stored, so nothing in a
checkpoint depends on the world size, the alignment or the bucketing it was saved with: a load
at any world size (and any ``alignment``/``bucket_bytes``) maps the new rank's shard to global
ranges and reads, from each old file that overlaps them (:func:`overlaps`), only those element
ranges (``safe_open(...).get_slice(key)[a:b]`` on a memory map). Padding comes back as zeros,
which is what the step keeps it at (zero grads, zero weights, zero moments). Integrity: with
``load(verify=True)`` (the default) each file is also hashed in full, once, by the new rank
that reads most of it (:func:`verifiers`; so the whole checkpoint is read once more in total,
spread over the ranks); ``verify=False`` reads only the ranges.

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
import json
import math
import os

import torch

from fzero.transforms import iter_hyperparams, with_host_value
from fzero.transforms.combine import MaskedState
from fzero.transforms.tree import named_tuples

from ..layout import Layout
from ..scaler import DynamicLossScale, LossScaleState
from .snapshot import Template, check_shard, vanished
from .form import converts
from .strict_json import CheckpointError, dtype_name, from_json_value

__all__ = ["overlaps", "verifiers", "check_sums", "read_state", "mask_differences"]

try:  # a declared dependency; guarded so that ``import fzero`` works without it
    from safetensors import safe_open
except ImportError:  # pragma: no cover
    safe_open = None


# ---------------------------------------------------------------------------------- the reading plan
def overlaps(old_segments, new_segments):
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


def verifiers(files: list, new_segments: list) -> list[int]:
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


def check_sums(path: str, snapshot: str, files: list, new_segments: list, rank: int) -> None:
    """The files this rank hashes (``verifiers``) match the manifest's sha256."""
    for entry, owner in zip(files, verifiers(files, new_segments)):
        if owner != rank:
            continue
        file = os.path.join(path, snapshot, entry["file"])
        try:
            check_shard(file, entry, sha256=True)
        except FileNotFoundError:
            raise vanished(path, snapshot, file, "shard file") from None


# ---------------------------------------------------------------------------------- reading
def _restore_scaler(saved: dict, fresh: LossScaleState, engine) -> LossScaleState:
    """The saved loss-scale state, field by field; fields the checkpoint lacks keep the fresh
    value. A static (or no) loss scale is configuration, not state: its scale stays the
    engine's, so resuming FP16 with dynamic scaling as BF16 without scaling works."""
    dynamic = isinstance(engine.loss_scale, DynamicLossScale)
    fields = {}
    for name, old in zip(type(fresh)._fields, fresh):
        keep = name not in saved or (name == "scale" and not dynamic)
        fields[name] = old if keep else from_json_value(saved[name], old.dtype, old.device)
    return type(fresh)(**fields)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    x, y = a.item(), b.item()
    return x == y or (x != x and y != y)  # nan == nan here


def _first_leaves(manifest: dict, t: Template, hyperparams: str) -> tuple[list, list, dict]:
    """The 0-d leaves (hyperparameters from the engine or the checkpoint, the rest from the
    checkpoint) and zeroed ``[S]`` buffers to read into; ``[(name, saved, engine)]`` for every
    hyperparameter whose values differ; ``{index: the engine's mask}`` for each mask leaf."""
    saved = {e["name"]: e for e in manifest["state"]}
    hyper = {id(leaf) for _, leaf in iter_hyperparams(t.state)}
    masks = {id(node.mask) for node in named_tuples(t.state) if isinstance(node, MaskedState)}
    out, differ, engine_masks, seen = [], [], {}, set()
    for i, (name, leaf, kind) in enumerate(zip(t.names, t.leaves, t.kinds)):
        if kind in ("shard", "replicated"):  # fill the template's own buffers (no second copy of the state), padding zero
            if id(leaf) in masks:
                engine_masks[i] = leaf.detach().clone()
            if leaf.untyped_storage().data_ptr() in seen:
                leaf = torch.empty_like(leaf)
            seen.add(leaf.untyped_storage().data_ptr())
            out.append(leaf.detach().zero_())
            continue
        value = from_json_value(saved[name]["value"], leaf.dtype, leaf.device)
        if id(leaf) in hyper:
            value = with_host_value(value, float(saved[name]["value"]))  # for fused kernels (no device read)
            if not _same(value, leaf):
                differ.append((name, value.item(), leaf.item()))
            if hyperparams == "engine":
                value = leaf
        out.append(value)
    return out, differ, engine_masks


def _mask_counts(t: Template, out: list, engine_masks: dict, owned, layout: Layout) -> dict:
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


def mask_differences(counts_by_rank: list) -> list[str]:
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


def _read_file(path: str, snapshot: str, entry: dict, pieces: list, t: Template, out: list) -> None:
    """Copy the ``pieces`` of one old shard file into this rank's buffers ``out``, and, from the
    first rank's file, every replicated leaf whole."""
    file = os.path.join(path, snapshot, entry["file"])
    length = sum(g1 - g0 for g0, g1 in entry["segments"])
    try:
        f = safe_open(file, framework="pt")
    except Exception as e:  # noqa: BLE001
        if not os.path.exists(file):
            raise vanished(path, snapshot, file, "shard file") from None
        raise CheckpointError(f"shard file {file} cannot be opened: {e}") from e
    with f:
        meta = f.metadata() or {}
        if json.loads(meta.get("segments", "null")) != entry["segments"]:
            raise CheckpointError(f"shard file {file} does not hold the ranges the manifest lists for it")
        keys = set(f.keys())
        for i, (name, kind) in enumerate(zip(t.names, t.kinds)):
            if kind == "scalar" or kind == "replicated" and entry["rank"] != 0:
                continue
            if name not in keys:
                raise CheckpointError(f"shard file {file} has no tensor for state leaf {name!r}")
            sl = f.get_slice(name)
            if kind == "replicated":
                src = sl[:] if sl.get_shape() == [out[i].numel()] else None
                if src is None or src.dtype != out[i].dtype:
                    raise CheckpointError(f"shard file {file}: state leaf {name!r} is {sl.get_shape()} {sl.get_dtype()}, "
                                          f"expected [{out[i].numel()}] {out[i].dtype}")
                out[i].view(-1).copy_(src)
                continue
            if sl.get_shape() != [length]:
                raise CheckpointError(f"shard file {file}: state leaf {name!r} has shape {sl.get_shape()}, expected [{length}]")
            for fpos, spos, m in pieces:
                src = sl[fpos : fpos + m]
                if not converts(dtype_name(src.dtype), dtype_name(out[i].dtype)):
                    raise CheckpointError(f"shard file {file}: state leaf {name!r} is {src.dtype}, expected {out[i].dtype}")
                out[i][spos : spos + m].copy_(src)


def read_state(path, snapshot, manifest, t: Template, owned, engine, hyperparams) -> tuple:
    """Every rank: its leaves of the state (``owned``: its ``Layout.owned`` ranges), the
    loss-scale state, the differing hyperparameters, its ``_mask_counts`` (``None`` with
    ``hyperparams="checkpoint"`` or no masks)."""
    out, differ, engine_masks = _first_leaves(manifest, t, hyperparams)
    whole = "replicated" in t.kinds  # read from the first rank's file by every rank
    for entry in manifest["files"]:
        pieces = overlaps(entry["segments"], owned)
        if pieces or whole and entry["rank"] == 0:
            _read_file(path, snapshot, entry, pieces, t, out)
    counts = None  # the same on every rank: whether they all take part in gathering the counts
    if hyperparams == "engine" and engine_masks:
        counts = _mask_counts(t, out, engine_masks, owned, engine.layout)
        for i, mine in engine_masks.items():
            out[i].copy_(mine)
    return out, _restore_scaler(manifest["loss_scale"], t.scaler, engine), differ, counts
