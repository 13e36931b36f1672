"""Sharded checkpoints that survive crashes and load at any world size.

API (every function is collective: call it on every rank of the engine's group)::

    save(path, params, state, scaler_state, engine, *, extra=None) -> None
    load(path, engine, *, verify=True) -> (params, state, scaler_state, extra)
    export_full(path, params_or_state, engine) -> None
    read_manifest(path) -> dict                      # any process, no group needed

A checkpoint is a directory::

    path/manifest.json                          written by rank 0, last
    path/shard-00000-of-00002.safetensors       written by rank 0
    path/shard-00001-of-00002.safetensors       written by rank 1

**Global coordinates.** Every ``[S]`` leaf of the optimizer state (FP32 master, Adam moments,
bool masks) is a slice of one virtual ``[P]`` vector: the params' leaves concatenated in tree
order, *without* padding. Rank ``r``'s file holds, under the state leaf's path as key
(``"master"``, ``"tx_state/0/mu"``, ``"tx_state/1/mask"`` for ``adamw`` with a decay mask), the
real elements of its shard in increasing global order; the manifest lists which global ranges
(``segments``) each file holds. Padding is never stored, so nothing in a checkpoint depends on
the world size, the alignment or the bucketing it was saved with: a load at any world size (and
any ``alignment``/``bucket_bytes``) maps the new rank's shard to global ranges and reads, from
each old file that overlaps them, only those element ranges (``safe_open(...).get_slice(key)[a:b]``
on a memory map). Padding comes back as zeros, which is what the step keeps it at (zero grads,
zero weights, zero moments). Integrity: with ``load(verify=True)`` (the default) each file is
also hashed in full, once, by the new rank that reads most of it (so the whole checkpoint is
read once more in total, spread over the ranks); ``verify=False`` reads only the ranges.

0-d leaves (step counts, hyperparameters, the loss-scale state) are identical on every rank;
rank 0's values are stored in the manifest as exact JSON numbers with their dtype (float64
values round-trip through JSON bit for bit). Params are not stored: they are the all-gather of
the master cast to ``param_dtype`` -- exactly what every step computes -- so ``load`` rebuilds
them bit for bit.

**Why safetensors per rank, not torch.distributed.checkpoint (DCP) or a new format.**

* DCP reshards ``DTensor``/``ShardedTensor`` chunks. fzero's shards are padded, 64-aligned
  element ranges of a flat buffer whose padded size changes with the world size, packed in
  buckets: they are neither ``DTensor``'s ``torch.chunk`` pattern (``Shard(0)`` of ``[P]`` puts
  ``ceil(P/N)`` elements per rank) nor a fixed global shape, so they would have to be
  described as ``ShardedTensor`` metadata (deprecated in torch) or copied into a re-chunked
  ``DTensor`` on every save and load. DCP also writes its ``.metadata`` file with
  ``pickle.dump`` and reads it with ``pickle.load`` (``torch/distributed/checkpoint/filesystem.py``),
  which this format must not contain, and it writes into the target directory in place, so
  overwriting a checkpoint is not atomic.
* safetensors is a plain, pickle-free container (8-byte header length, JSON header, raw
  little-endian bytes) readable from Rust/NumPy/JAX, with ranged, memory-mapped reads through
  ``get_slice`` -- the primitive DCP's own ``HuggingFaceStorageReader`` uses for resharding.
  One file per rank means every rank writes in parallel and no two ranks touch a file.
* What is hand-written is only the small JSON manifest (layout, segments, scalars,
  checksums) and the commit protocol below; no tensor bytes are in a home-made format.

**Crash safety.** ``save`` writes into a fresh ``<path>.tmp-<id>`` next to ``path``. Every rank
writes and fsyncs its shard, then reports its sha256; rank 0 writes the manifest last, fsyncs,
and only then moves the directory into place: ``rename`` if ``path`` does not exist, else an
atomic exchange of the two directories (Linux ``renameat2(RENAME_EXCHANGE)``), after which the
old checkpoint (now under the temporary name) is deleted. Where the exchange is unsupported
(not Linux, or a filesystem without it), ``path`` is first renamed to ``<path>.old-<id>``; a
crash between the two renames leaves no ``path`` but a complete ``<path>.old-<id>``, which
``load`` then reads (and the next ``save`` puts back). A crash at any earlier point leaves
``path`` untouched; leftovers ``<path>.tmp-*`` are ignored by ``load`` and removed by the next
``save``. Concurrent saves to one path are not supported. ``path`` must be on a filesystem
that every rank sees (a shared filesystem on several nodes).

**Errors are agreed.** Every phase that may fail on some ranks (filesystem errors, a missing,
truncated or corrupted shard, a checkpoint of another model) ends with one small
``all_gather_object`` of each rank's error (or ``None``); if any rank failed, *every* rank
raises the same :class:`CheckpointError`, naming the rank(s), the file and, for a model or
state mismatch, the leaf. No rank is left waiting in a collective for a rank that gave up.
A rank that dies outright ends the others' wait through the process group (gloo reports the
closed connection at once; NCCL through its timeout/watchdog).
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import glob
import hashlib
import json
import math
import os
import shutil
import sys
import uuid
import warnings
from typing import Any, Callable

import optree
import torch

from .engine import Engine, ZeroState
from .flat import Layout, unflatten
from .scaler import DynamicLossScale, LossScaleState

try:  # a declared dependency; imported lazily so ``import fzero`` works without it
    from safetensors import safe_open
    from safetensors.torch import save_file
except ImportError:  # pragma: no cover
    safe_open = save_file = None

__all__ = ["CheckpointError", "save", "load", "export_full", "read_manifest", "FORMAT", "VERSION"]

FORMAT = "fzero-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
EXPORT_FORMAT = "fzero-export"

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}

# Test hook: ``_test_hook(point, **info)`` is called at each step of the save protocol
# ("tmp_created", "shard_written", "manifest_written", "between_renames", "committed") so a
# test can kill the process there. ``_use_exchange = False`` forces the two-rename fallback.
_test_hook: Callable[..., None] | None = None
_use_exchange = True


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file/leaf and rank(s)."""


def _hook(point: str, **info) -> None:
    if _test_hook is not None:
        _test_hook(point, **info)


def _need_safetensors() -> None:
    if safe_open is None:
        raise ImportError("fzero.checkpoint needs the safetensors package: pip install safetensors")


# ---------------------------------------------------------------------------------- layout maps
def _rank_segments(layout: Layout) -> list[list[tuple[int, int, int]]]:
    """For every rank of ``layout``: ``[(g0, g1, pos), ...]``, the global (unpadded, tree-order)
    element ranges ``[g0, g1)`` of the real elements it owns, sorted, with ``pos`` the position
    of ``g0`` in its ``[S]`` shard; adjacent ranges are merged.

    Reads only ``offsets``, ``shapes``, ``shard_ranges(0)`` and ``world_size``: valid for any
    bucketing (buckets of any leaf order) and alignment."""
    n = layout.world_size
    ranges0 = layout.shard_ranges(0)
    # bucket b spans flat [start_b, start_b + n*shard_b); rank r's slice starts at pos_b in its shard
    starts, shards, poss = [], [], []
    pos = 0
    for lo, hi in ranges0:
        starts.append(lo)
        shards.append(hi - lo)
        poss.append(pos)
        pos += hi - lo
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    g = 0
    for off, shape in zip(layout.offsets, layout.shapes):
        numel = math.prod(shape)
        if numel:
            b = bisect.bisect_right(starts, off) - 1
            start, shard = starts[b], shards[b]
            first, last = (off - start) // shard, (off + numel - 1 - start) // shard
            for r in range(first, last + 1):
                lo = start + r * shard
                s, e = max(off, lo), min(off + numel, lo + shard)
                out[r].append((g + s - off, g + e - off, poss[b] + s - lo))
        g += numel
    merged = []
    for segs in out:
        segs.sort()
        m: list[tuple[int, int, int]] = []
        for g0, g1, p in segs:
            if m and m[-1][1] == g0 and m[-1][2] + (m[-1][1] - m[-1][0]) == p:
                m[-1] = (m[-1][0], g1, m[-1][2])
            else:
                m.append((g0, g1, p))
        merged.append(m)
    return merged


def _leaf_table(layout: Layout) -> list[dict]:
    out, g = [], 0
    for path, shape in zip(layout.paths, layout.shapes):
        out.append({"path": path, "shape": list(shape), "offset": g})
        g += math.prod(shape)
    return out


def _state_paths(tree: Any) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """Leaf names like ``"tx_state/1/0/mu"`` (NamedTuple fields by name), leaves, treespec."""
    try:
        accessors, leaves, spec = optree.tree_flatten_with_accessor(tree)
        names = []
        for acc in accessors:
            parts = [str(e.field) if hasattr(e, "field") else str(e.entry) for e in acc]
            names.append("/".join(parts) or "<root>")
    except AttributeError:  # optree < 0.14: indices only
        paths, leaves, spec = optree.tree_flatten_with_path(tree)
        names = ["/".join(str(k) for k in p) or "<root>" for p in paths]
    return names, leaves, spec


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _classify(names, leaves, shard_numel: int) -> list[str]:
    kinds = []
    for name, leaf in zip(names, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise CheckpointError(f"state leaf {name!r} is a {type(leaf).__name__}, not a tensor; cannot checkpoint it")
        if leaf.ndim == 0:
            kinds.append("scalar")
        elif leaf.ndim == 1 and leaf.shape[0] == shard_numel:
            kinds.append("shard")
        else:
            raise CheckpointError(
                f"state leaf {name!r} has shape {tuple(leaf.shape)}: only [S]={shard_numel}-element shards "
                "and 0-d tensors can be checkpointed"
            )
        if _dtype_name(leaf.dtype) not in _DTYPES:
            raise CheckpointError(f"state leaf {name!r} has unsupported dtype {leaf.dtype}")
    return kinds


# ---------------------------------------------------------------------------------- collectives
def _agree(comm, what: str, fn: Callable[[], Any], *, gather: bool = False):
    """Run ``fn`` on every rank, then one ``all_gather_object`` of each rank's error (and, with
    ``gather``, its small picklable result). If any rank failed, every rank raises the same
    :class:`CheckpointError` naming the failing ranks. Returns this rank's result, or with
    ``gather`` the list of every rank's. ``what`` names the phase in errors."""
    try:
        result, err, exc = fn(), None, None
    except Exception as e:  # noqa: BLE001 -- reported to every rank, then raised
        result, err, exc = None, str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}", e
    if comm.world_size == 1:
        if exc is not None:
            if isinstance(exc, CheckpointError):
                raise exc
            raise CheckpointError(err) from exc
        return [result] if gather else result
    try:
        gathered = comm.all_gather_object((err, result if gather else None))
    except Exception as e:  # noqa: BLE001 -- a dead rank, a timeout: the group itself failed
        raise CheckpointError(
            f"{what}: rank {comm.rank} could not agree with the other ranks (did one die?): {type(e).__name__}: {e}"
        ) from (exc or e)
    failed: dict[str, list[int]] = {}
    for rank, (e, _) in enumerate(gathered):
        if e is not None:
            failed.setdefault(e, []).append(rank)
    if failed:
        msg = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {e}" for e, r in failed.items())
        raise CheckpointError(f"{what}: {msg}") from exc
    return [r for _, r in gathered] if gather else result


def _ready(engine: Engine):
    if engine.layout is None:
        raise RuntimeError("fzero.checkpoint needs an engine after engine.init (it supplies the layout)")
    comm = engine.comm
    if getattr(comm, "simulated", False):
        raise RuntimeError("cannot checkpoint a simulated engine (zero1(simulate=...))")
    comm.check_unchanged()
    return engine.layout, comm


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
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        if fsync:
            os.fsync(f.fileno())
        while chunk := f.read(1 << 24):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _rename_exchange(src: str, dst: str) -> bool:
    """Atomically swap two directories (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    if not _use_exchange or not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), dst)


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def _recovery_dirs(path: str) -> list[str]:
    """Complete ``<path>.old-*`` checkpoints, newest first (left by a crash between renames)."""
    olds = [d for d in glob.glob(glob.escape(path) + ".old-*") if _is_checkpoint(d)]
    return sorted(olds, key=lambda d: os.path.getmtime(os.path.join(d, MANIFEST)), reverse=True)


def _resolve(path: str) -> str:
    """The directory holding the committed checkpoint at ``path``."""
    if _is_checkpoint(path):
        return path
    if not os.path.lexists(path):
        olds = _recovery_dirs(path)
        if olds:
            warnings.warn(f"no checkpoint at {path}; reading {olds[0]} left by a save interrupted while committing")
            return olds[0]
        raise CheckpointError(f"no checkpoint at {path}: it does not exist")
    raise CheckpointError(f"no checkpoint at {path}: {os.path.join(path, MANIFEST)} is missing")


def read_manifest(path) -> dict:
    """The parsed ``manifest.json`` of the checkpoint at ``path`` (no process group needed)."""
    file = os.path.join(_resolve(os.path.abspath(os.fspath(path))), MANIFEST)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {file}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not an fzero checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{file} has format version {manifest.get('version')}; this fzero reads version {VERSION}")
    return manifest


def _json_value(t: torch.Tensor):
    v = t.item()
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # "inf", "-inf", "nan": kept strict JSON
    return v


def _from_json_value(v, dtype: torch.dtype, device) -> torch.Tensor:
    if isinstance(v, str):
        v = float(v)
    return torch.tensor(v, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------- save
def _prepare_tmp(path: str) -> str:
    """Rank 0: put back a checkpoint left under ``.old-*``, clear leftovers, make the tmp dir."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    if os.path.lexists(path):
        if not os.path.isdir(path) or (os.listdir(path) and not _is_checkpoint(path)):
            raise CheckpointError(f"refusing to overwrite {path}: it exists and is not an fzero checkpoint")
    else:
        olds = _recovery_dirs(path)
        if olds:  # a save crashed between its two renames: restore the previous checkpoint first
            os.rename(olds[0], path)
    for d in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        shutil.rmtree(d, ignore_errors=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    os.mkdir(tmp)
    _fsync_dir(parent)
    _hook("tmp_created", tmp=tmp)
    return tmp


def _write_shard(tmp, rank, world_size, names, leaves, kinds, segments) -> dict:
    _need_safetensors()
    fname = f"shard-{rank:05d}-of-{world_size:05d}.safetensors"
    file = os.path.join(tmp, fname)
    tensors = {}
    for name, leaf, kind in zip(names, leaves, kinds):
        if kind != "shard":
            continue
        parts = [leaf.detach()[p : p + g1 - g0] for g0, g1, p in segments]
        t = parts[0] if len(parts) == 1 else (torch.cat(parts) if parts else leaf.new_empty(0))
        tensors[name] = t.to("cpu").contiguous()
    meta = {
        "format": FORMAT,
        "version": str(VERSION),
        "rank": str(rank),
        "world_size": str(world_size),
        "segments": json.dumps([[g0, g1] for g0, g1, _ in segments]),
    }
    save_file(tensors, file, metadata=meta)
    _hook("shard_written", file=file, rank=rank)
    sha, size = _sha256(file, fsync=True)
    _fsync_dir(tmp)
    return {"file": fname, "rank": rank, "segments": [[g0, g1] for g0, g1, _ in segments], "bytes": size, "sha256": sha}


def _commit(tmp: str, path: str) -> None:
    """Move the finished ``tmp`` directory to ``path`` (atomically where the OS allows)."""
    parent = os.path.dirname(path)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _rename_exchange(tmp, path):
        _fsync_dir(parent)
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous checkpoint
    else:
        old = f"{path}.old-{uuid.uuid4().hex[:12]}"
        os.rename(path, old)
        _hook("between_renames", old=old)
        try:
            os.rename(tmp, path)
        except OSError:
            os.rename(old, path)
            raise
        _fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(parent)
    _hook("committed", path=path)


def save(path, params: Any, state: ZeroState, scaler_state: LossScaleState, engine: Engine, *, extra: dict | None = None) -> None:
    """Save a checkpoint of ``(state, scaler_state)`` to the directory ``path``; collective.

    Each rank writes the real elements of its own shard of every ``[S]`` state leaf (one
    safetensors file per rank, in parallel); rank 0 writes ``manifest.json`` (layout, 0-d
    leaves, loss-scale state, ``extra``, sha256 of each file) last and moves the directory
    into place. An existing checkpoint at ``path`` is replaced only once the new one is
    complete. ``params`` are not stored (they are the master cast to ``param_dtype``); they
    are checked against the layout. ``extra``: a small JSON-serializable dict (rank 0's is
    saved), e.g. the data loader's position.
    """
    layout, comm = _ready(engine)
    path = os.path.abspath(os.fspath(path))
    rank, n = comm.rank, comm.world_size

    def check():
        if not isinstance(state, ZeroState):
            raise CheckpointError(f"state must be the ZeroState from engine.init/step, got {type(state).__name__}")
        if optree.tree_structure(params) != layout.treespec:
            raise CheckpointError("params do not have the structure the engine was initialized with")
        if not isinstance(scaler_state, LossScaleState):
            raise CheckpointError(f"scaler_state must be the LossScaleState from engine.init/step, got {type(scaler_state).__name__}")
        names, leaves, _ = _state_paths(state)
        kinds = _classify(names, leaves, layout.shard_numel)
        if extra is not None and not isinstance(extra, dict):
            raise CheckpointError(f"extra must be a dict or None, got {type(extra).__name__}")
        text = json.dumps(extra if extra is not None else {})
        return names, leaves, kinds, text

    names, leaves, kinds, extra_text = _agree(comm, f"save {path}", check)
    tmp = _agree(comm, f"save {path}", lambda: _prepare_tmp(path) if rank == 0 else None, gather=True)[0]
    try:
        segments = _rank_segments(layout)[rank]
        files = _agree(comm, f"save {path}", lambda: _write_shard(tmp, rank, n, names, leaves, kinds, segments), gather=True)

        def finish():
            if rank != 0:
                return None
            manifest = _manifest(layout, engine, names, leaves, kinds, scaler_state, extra_text, files)
            file = os.path.join(tmp, MANIFEST)
            with open(file, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            _hook("manifest_written", file=file)
            _commit(tmp, path)
            return None

        _agree(comm, f"save {path}", finish)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _manifest(layout, engine, names, leaves, kinds, scaler_state, extra_text, files) -> dict:
    state_table, step = [], None
    for name, leaf, kind in zip(names, leaves, kinds):
        entry = {"name": name, "kind": kind, "dtype": _dtype_name(leaf.dtype)}
        if kind == "scalar":
            entry["value"] = _json_value(leaf)
            if step is None and name.rsplit("/", 1)[-1] == "count" and not leaf.is_floating_point():
                step = entry["value"]
        state_table.append(entry)
    scale_names = list(LossScaleState._fields)
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": layout.world_size,
        "param_dtype": _dtype_name(engine.param_dtype),
        "step": step,
        "layout": {
            "numel": layout.numel,
            "leaves": _leaf_table(layout),
            "saved_with": {"world_size": layout.world_size, "alignment": layout.alignment,
                           "shard_numel": layout.shard_numel, "buckets": len(layout.buckets)},
        },
        "state": state_table,
        "loss_scale": {
            "policy": repr(engine.loss_scale),
            **{k: _json_value(v) for k, v in zip(scale_names, scaler_state)},
            "dtypes": {k: _dtype_name(v.dtype) for k, v in zip(scale_names, scaler_state)},
        },
        "extra": json.loads(extra_text),
        "files": files,
        "torch_version": torch.__version__,
    }


# ---------------------------------------------------------------------------------- load
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


def _check_files(manifest: dict, root: str, numel: int) -> None:
    """Every listed file exists with its recorded size; their ranges tile ``[0, P)`` exactly."""
    ranges = sorted((g0, g1) for e in manifest["files"] for g0, g1 in e["segments"])
    end = 0
    for g0, g1 in ranges:
        if g0 != end or g1 <= g0:
            raise CheckpointError(f"{root}/{MANIFEST}: the shard files' ranges do not tile [0, {numel}) (at {g0})")
        end = g1
    if end != numel:
        raise CheckpointError(f"{root}/{MANIFEST}: the shard files cover {end} of {numel} elements")
    for entry in manifest["files"]:
        file = os.path.join(root, entry["file"])
        if os.path.basename(entry["file"]) != entry["file"]:
            raise CheckpointError(f"{root}/{MANIFEST}: bad file name {entry['file']!r}")
        if not os.path.isfile(file):
            raise CheckpointError(f"shard file {file} is missing")
        size = os.path.getsize(file)
        if size != entry["bytes"]:
            raise CheckpointError(f"shard file {file} has {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)")


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
    page cache serves its reads), else round robin for files with no real elements."""
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


def _restore_scaler(saved: dict, fresh: LossScaleState, engine: Engine) -> LossScaleState:
    """The saved loss-scale state, field by field; fields the checkpoint lacks keep the fresh
    value. A static (or no) loss scale is configuration, not state: its scale stays the
    engine's, so resuming FP16 with dynamic scaling as BF16 without scaling works."""
    dynamic = isinstance(engine.loss_scale, DynamicLossScale)
    fields = {}
    for name, old in zip(type(fresh)._fields, fresh):
        keep = name not in saved or (name == "scale" and not dynamic)
        fields[name] = old if keep else _from_json_value(saved[name], old.dtype, old.device)
    return type(fresh)(**fields)


def load(path, engine: Engine, *, verify: bool = True):
    """Load the checkpoint at ``path`` into ``engine``'s layout; collective.

    ``engine`` must have been ``init``-ed with params of the same model (a fresh init is fine),
    at any world size, alignment or bucketing. Returns new ``(params, state, scaler_state,
    extra)``: the state holds this rank's shard of the saved global master/moments/masks and
    the saved 0-d leaves; ``params`` are the all-gather of the master cast to the engine's
    ``param_dtype``. The loss-scale state is restored, except that a static (or no) loss
    scale keeps the engine's own fixed scale.

    ``verify``: check the sha256 of every shard file first, each file hashed by one rank (the
    one that reads most of it). Each rank then reads only the element ranges of the old files
    that overlap its new shard.
    """
    _need_safetensors()
    layout, comm = _ready(engine)
    path = os.path.abspath(os.fspath(path))
    rank, n = comm.rank, comm.world_size
    new_segments = _rank_segments(layout)

    def open_manifest():
        root = _resolve(path)
        manifest = read_manifest(root)
        where = os.path.join(root, MANIFEST)
        template, scaler = engine.state_like()
        names, leaves, spec = _state_paths(template)
        kinds = _classify(names, leaves, layout.shard_numel)
        try:
            _check_model(manifest, layout, where)
            _check_state(manifest, names, leaves, kinds, where)
            _check_files(manifest, root, layout.numel)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from e
        return root, manifest, (names, leaves, spec, kinds, scaler)

    root, manifest, (names, leaves, spec, kinds, scaler) = _agree(comm, f"load {path}", open_manifest)
    files = manifest["files"]

    if verify:
        def check_sums():
            for entry, owner in zip(files, _verifiers(files, new_segments)):
                if owner != rank:
                    continue
                file = os.path.join(root, entry["file"])
                sha, _ = _sha256(file)
                if sha != entry["sha256"]:
                    raise CheckpointError(
                        f"shard file {file} is corrupted: sha256 {sha} but the manifest says {entry['sha256']}"
                    )

        _agree(comm, f"load {path}", check_sums)

    def read():
        saved = {e["name"]: e for e in manifest["state"]}
        out, seen = [], set()
        for name, leaf, kind in zip(names, leaves, kinds):
            if kind == "scalar":
                out.append(_from_json_value(saved[name]["value"], leaf.dtype, leaf.device))
            else:  # fill the template's own buffers (no second copy of the state), padding zero
                if leaf.untyped_storage().data_ptr() in seen:
                    leaf = torch.empty_like(leaf)
                seen.add(leaf.untyped_storage().data_ptr())
                out.append(leaf.detach().zero_())
        for entry in files:
            pieces = _overlaps(entry["segments"], new_segments[rank])
            if not pieces:
                continue
            file = os.path.join(root, entry["file"])
            length = sum(g1 - g0 for g0, g1 in entry["segments"])
            try:
                f = safe_open(file, framework="pt")
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"shard file {file} cannot be opened: {e}") from e
            with f:
                meta = f.metadata() or {}
                if json.loads(meta.get("segments", "null")) != entry["segments"]:
                    raise CheckpointError(f"shard file {file} does not hold the ranges the manifest lists for it")
                keys = set(f.keys())
                for i, (name, kind) in enumerate(zip(names, kinds)):
                    if kind != "shard":
                        continue
                    if name not in keys:
                        raise CheckpointError(f"shard file {file} has no tensor for state leaf {name!r}")
                    sl = f.get_slice(name)
                    if sl.get_shape() != [length]:
                        raise CheckpointError(
                            f"shard file {file}: state leaf {name!r} has shape {sl.get_shape()}, expected [{length}]"
                        )
                    for fpos, spos, m in pieces:
                        src = sl[fpos : fpos + m]
                        if src.dtype != out[i].dtype:
                            raise CheckpointError(f"shard file {file}: state leaf {name!r} is {src.dtype}, expected {out[i].dtype}")
                        out[i][spos : spos + m].copy_(src)
        return out, _restore_scaler(manifest["loss_scale"], scaler, engine)

    new_leaves, scaler = _agree(comm, f"load {path}", read)
    state = spec.unflatten(new_leaves)
    with torch.no_grad():
        shard = state.master.to(engine.param_dtype, copy=True).to(engine.device)
        params = unflatten(comm.all_gather(shard, layout), layout)
    return params, state, scaler, manifest.get("extra", {})


# ---------------------------------------------------------------------------------- export
def export_full(path, params_or_state, engine: Engine) -> None:
    """Write one consolidated safetensors file at ``path``, keyed by leaf path
    (``"blocks/0/attn/qkv_w"``): the FP32 master weights when given the ``ZeroState`` (an
    all-gather: call on every rank), or the ``param_dtype`` params when given the params.
    Rank 0 writes it (to a temporary file, then an atomic rename); collective.

    For an ``nn.Module``: ``module.load_state_dict({k.replace("/", "."): v for k, v in
    safetensors.torch.load_file(path).items()})``.
    """
    _need_safetensors()
    layout, comm = _ready(engine)
    path = os.path.abspath(os.fspath(path))
    if isinstance(params_or_state, ZeroState):
        master = params_or_state.master
        if master.shape != (layout.shard_numel,):
            raise CheckpointError(f"state.master has shape {tuple(master.shape)}, the layout needs ({layout.shard_numel},)")
        with torch.no_grad():
            flat = comm.all_gather(master.detach().to(engine.device), layout)
        leaves = optree.tree_leaves(unflatten(flat, layout))
        kind = "master"
    else:
        if optree.tree_structure(params_or_state) != layout.treespec:
            raise CheckpointError("params do not have the structure the engine was initialized with")
        leaves = optree.tree_leaves(params_or_state)
        kind = "params"

    def write():
        if comm.rank != 0:
            return None
        tensors = {p: leaf.detach().to("cpu").clone().contiguous() for p, leaf in zip(layout.paths, leaves)}
        meta = {"format": EXPORT_FORMAT, "kind": kind, "dtype": _dtype_name(leaves[0].dtype)}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            save_file(tensors, tmp, metadata=meta)
            _sha256(tmp, fsync=True)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        _fsync_dir(os.path.dirname(path))
        return None

    _agree(comm, f"export_full {path}", write)
