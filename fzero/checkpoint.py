"""Sharded checkpoints that survive crashes, never mix two saves, and load at any world size.

API (every function but ``read_manifest`` is collective: call it on every rank of the engine's
group)::

    save(path, params, state, scaler_state, engine, *, extra=None) -> None
    load(path, engine, *, verify=True, hyperparams="engine") -> (params, state, scaler_state, extra)
    export_full(path, params_or_state, engine) -> None
    read_manifest(path) -> dict                      # any process, no group needed

A checkpoint is a directory of immutable snapshots and a pointer to the current one::

    path/fzero-checkpoint.json                            marker: the snapshots fzero created here
    path/current.json                                     pointer: current snapshot + its manifest's sha256
    path/snapshot-<32 hex>/manifest.json                  written by rank 0, last
    path/snapshot-<32 hex>/shard-00000-of-00002.safetensors   written by rank 0
    path/snapshot-<32 hex>/shard-00001-of-00002.safetensors   written by rank 1

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

**Commit protocol.** A snapshot directory is written once, by one save, and never modified;
its name ``snapshot-<uuid4 hex>`` is never reused. ``save``:

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

**A load reads one snapshot.** Rank 0 reads the pointer once; every rank receives the snapshot
name and manifest sha256 from it (through the agreement below), reads that snapshot's manifest
and checks its sha256 against the pointer's. As snapshots are immutable and names unique,
everything a load returns comes from one save. A save that commits during a load keeps the
loaded snapshot; a second one deletes it, and a load still reading it then raises
``CheckpointError`` ("replaced while loading"; load again) -- never data of two saves.

**Validation.** Manifest, pointer and marker are parsed strictly (no ``NaN``/``Infinity``
tokens, no out-of-range numbers, no duplicate keys), and every value of the manifest is checked
before use (:func:`_validate_manifest`): types (integers are JSON integers, 0-d values JSON
numbers of their dtype, dtypes known names), counts >= 0, the loss scale finite and > 0 (and for
a ``DynamicLossScale`` engine within its ``[min_scale, max_scale]``), the built-in
hyperparameters in the ranges their transforms accept (``transforms.base.HYPERPARAM_RULES``). A
bad value raises ``CheckpointError`` naming the field. ``save`` validates the manifest it is
about to write the same way; ``extra`` must be strict JSON (no NaN or infinity).

**Hyperparameters on load.** The 0-d state leaves named in a state NamedTuple's
``HYPERPARAMS`` (``lr``, ``b1``, ``b2``, ``eps``, ``weight_decay``, ``max_norm``, ...; see
``transforms.get_hyperparams``) are the engine's own by default, with one warning listing
every one that differs from the checkpoint's; ``hyperparams="checkpoint"`` restores the saved
ones. Everything else (counts, moments, masks, master) always comes from the checkpoint.

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
import hashlib
import json
import math
import os
import re
import shutil
import uuid
import warnings
from typing import Any, Callable, NamedTuple

import optree
import torch

from transforms.base import HYPERPARAM_RULES

from .engine import Engine, ZeroState, cast_params
from .flat import Layout, leaf_paths, unflatten
from .scaler import DynamicLossScale, LossScaleState

try:  # a declared dependency; imported lazily so ``import fzero`` works without it
    from safetensors import safe_open
    from safetensors.torch import save_file
except ImportError:  # pragma: no cover
    safe_open = save_file = None

__all__ = ["CheckpointError", "save", "load", "export_full", "read_manifest", "FORMAT", "VERSION"]

FORMAT = "fzero-checkpoint"
VERSION = 2
MANIFEST = "manifest.json"
POINTER = "current.json"
MARKER = "fzero-checkpoint.json"
MARKER_FORMAT = "fzero-checkpoint-directory"
EXPORT_FORMAT = "fzero-export"
HYPERPARAMS_FROM = ("engine", "checkpoint")

_SNAPSHOT = re.compile(r"snapshot-[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_OWN_TMP = re.compile(r"\.(%s|%s)\.tmp-[0-9a-f]{12}" % (re.escape(POINTER), re.escape(MARKER)))

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}
_INT_RANGES = {n: torch.iinfo(d) for n, d in _DTYPES.items() if not d.is_floating_point and d != torch.bool}
_INT32_MAX = torch.iinfo(torch.int32).max


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file/leaf and rank(s)."""


def _no_hook(point: str, **info) -> None:
    """The default of ``save``/``load``'s private ``_hook(point, **info)``: tests pass one that
    kills the process (or saves concurrently) at a protocol point."""


def _need_safetensors() -> None:
    if safe_open is None:
        raise ImportError("fzero.checkpoint needs the safetensors package: pip install safetensors")


# ================================================================================== common
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


def _hyperparam_ids(tree: Any) -> set[int]:
    """``id`` of every leaf named in a NamedTuple's ``HYPERPARAMS`` (what
    ``transforms.get_hyperparams`` returns, without merging equal names)."""
    out, stack = set(), [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            out.update(id(getattr(node, name)) for name in getattr(type(node), "HYPERPARAMS", ()))
        if isinstance(node, (tuple, list)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return out


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


# ================================================================================== manifest
# ---------------------------------------------------------------------------------- strict JSON
def _reject_constant(token: str):
    raise ValueError(f"non-standard JSON token {token} (JSON has no NaN or infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of the float64 range")
    return value


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_json(data: bytes | str, file: str) -> Any:
    """Strict JSON: no ``NaN``/``Infinity`` tokens, no numbers that overflow, no duplicate keys."""
    try:
        return json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {file}: {e}") from e


def _dump_json(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, allow_nan=False).encode()


def _json_value(t: torch.Tensor):
    v = t.item()
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # "inf", "-inf", "nan": kept strict JSON
    return v


def _from_json_value(v, dtype: torch.dtype, device) -> torch.Tensor:
    if isinstance(v, str):
        v = float(v)
    return torch.tensor(v, dtype=dtype, device=device)


def _non_finite(obj: Any, where: str, seen: set[int] | None = None) -> tuple[str, float] | None:
    """``(where, value)`` of the first float in ``obj`` that is NaN or infinite, else None."""
    seen = set() if seen is None else seen
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (where, obj)
    if id(obj) in seen or not isinstance(obj, (dict, list, tuple)):
        return None
    seen.add(id(obj))
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for key, value in items:
        found = _non_finite(value, f"{where}[{key!r}]", seen)
        if found:
            return found
    return None


def _extra_json(extra: Any) -> str:
    """``extra`` as strict JSON text; CheckpointError naming the key of a NaN/infinity."""
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise CheckpointError(f"extra must be a dict or None, got {type(extra).__name__}")
    found = _non_finite(extra, "extra")
    if found:
        where, value = found
        raise CheckpointError(f"{where} = {value!r}: JSON has no NaN or infinity; store it as a string or None")
    try:
        return json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra is not JSON serializable: {e}") from e


# ---------------------------------------------------------------------------------- building
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


# ---------------------------------------------------------------------------------- validation
# Ranges of the 0-d state leaves the built-in transforms keep, by field name (the last part of
# the leaf's name): counts, and the hyperparameters with the ranges their factories and
# ``set_hyperparams`` accept (so a state that trains can be saved and loaded). Other 0-d
# leaves are checked against their dtype only.
_SCALAR_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "count": (lambda v: type(v) is int and v >= 0, "must be a non-negative integer"),
    **{name: (ok, f"must be {need}") for name, (ok, need) in HYPERPARAM_RULES.items()},
}
_NON_FINITE = ("inf", "-inf", "nan")  # how a non-finite float 0-d value is written


class _Fields:
    """Checks on the parsed JSON of one file; every failure is a CheckpointError naming the file
    and the field, e.g. ``manifest field state['tx_state/0/b2'].value = 1.5: must be in [0, 1)``."""

    def __init__(self, file: str, kind: str = "manifest"):
        self.file, self.kind = file, kind

    def fail(self, field: str, value: Any, need: str):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise CheckpointError(f"{self.file}: {self.kind} field {field} = {shown}: {need}")

    def get(self, obj: dict, key: str, at: str | None = None) -> Any:
        """``obj[key]``; ``at`` names ``obj`` (``None``: the top level)."""
        field = f"{at}.{key}" if at else key
        if key not in obj:
            raise CheckpointError(f"{self.file}: {self.kind} field {field} is missing")
        return obj[key]

    def mapping(self, field: str, value: Any) -> dict:
        if not isinstance(value, dict):
            self.fail(field, value, "must be a JSON object")
        return value

    def sequence(self, field: str, value: Any) -> list:
        if not isinstance(value, list):
            self.fail(field, value, "must be a JSON list")
        return value

    def string(self, field: str, value: Any, pattern: re.Pattern | None = None) -> str:
        if not isinstance(value, str):
            self.fail(field, value, "must be a string")
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(field, value, f"must match {pattern.pattern}")
        return value

    def integer(self, field: str, value: Any, lo: int = 0, hi: int | None = None) -> int:
        if type(value) is not int:  # not a bool, not 3.0
            self.fail(field, value, "must be an integer")
        if value < lo or (hi is not None and value > hi):
            self.fail(field, value, f"must be in [{lo}, {hi}]" if hi is not None else f"must be >= {lo}")
        return value

    def dtype(self, field: str, value: Any, *, floating: bool = False) -> str:
        if not isinstance(value, str) or value not in _DTYPES or (floating and not _DTYPES[value].is_floating_point):
            known = [n for n, d in _DTYPES.items() if d.is_floating_point or not floating]
            self.fail(field, value, f"must be one of {known}")
        return value

    def choice(self, field: str, value: Any, choices: tuple) -> Any:
        if value not in choices:
            self.fail(field, value, f"must be one of {list(choices)}")
        return value


def _validate_manifest(m: Any, file: str) -> dict:
    """Every field of a parsed manifest, or CheckpointError naming the first bad one."""
    c = _Fields(file)
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not an fzero checkpoint manifest")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{file} has format version {m.get('version')!r}; this fzero reads version {VERSION}")
    n = c.integer("world_size", c.get(m, "world_size"), lo=1)
    c.dtype("param_dtype", c.get(m, "param_dtype"), floating=True)
    if c.get(m, "step") is not None:
        c.integer("step", m["step"])
    numel = _validate_layout(c, c.mapping("layout", c.get(m, "layout")))
    _validate_state(c, c.sequence("state", c.get(m, "state")))
    _validate_loss_scale(c, c.mapping("loss_scale", c.get(m, "loss_scale")))
    c.mapping("extra", c.get(m, "extra"))
    _validate_files(c, c.sequence("files", c.get(m, "files")), n, numel)
    if "torch_version" in m:
        c.string("torch_version", m["torch_version"])
    return m


def _validate_layout(c: _Fields, layout: dict) -> int:
    numel = c.integer("layout.numel", c.get(layout, "numel", "layout"))
    total = 0
    for i, leaf in enumerate(c.sequence("layout.leaves", c.get(layout, "leaves", "layout"))):
        f = f"layout.leaves[{i}]"
        c.mapping(f, leaf)
        c.string(f"{f}.path", c.get(leaf, "path", f))
        shape = c.sequence(f"{f}.shape", c.get(leaf, "shape", f))
        for j, size in enumerate(shape):
            c.integer(f"{f}.shape[{j}]", size)
        if c.integer(f"{f}.offset", c.get(leaf, "offset", f)) != total:
            c.fail(f"{f}.offset", leaf["offset"], f"must be {total}, the size of the leaves before it")
        total += math.prod(shape)
    if numel != total:
        c.fail("layout.numel", numel, f"must be {total}, the size of all leaves")
    saved_with = c.mapping("layout.saved_with", c.get(layout, "saved_with", "layout"))
    for key, lo in (("world_size", 1), ("alignment", 1), ("shard_numel", 0), ("buckets", 0)):
        c.integer(f"layout.saved_with.{key}", c.get(saved_with, key, "layout.saved_with"), lo=lo)
    return numel


def _validate_state(c: _Fields, state: list) -> None:
    seen = set()
    for i, entry in enumerate(state):
        c.mapping(f"state[{i}]", entry)
        name = c.string(f"state[{i}].name", c.get(entry, "name", f"state[{i}]"))
        f = f"state[{name!r}]"
        if name in seen:
            c.fail(f"state[{i}].name", name, "must be unique")
        seen.add(name)
        kind = c.choice(f"{f}.kind", c.get(entry, "kind", f), ("scalar", "shard"))
        dtype = c.dtype(f"{f}.dtype", c.get(entry, "dtype", f))
        if kind == "scalar":
            _validate_scalar(c, f"{f}.value", c.get(entry, "value", f), dtype, name)


def _validate_scalar(c: _Fields, field: str, value: Any, dtype: str, name: str) -> None:
    """A 0-d value: a JSON number of its dtype (a float leaf may be "inf"/"-inf"/"nan"), then
    the range of its field name, if it is one of the built-in transforms'."""
    if dtype == "bool":
        if type(value) is not bool:
            c.fail(field, value, "must be true or false (a bool leaf)")
    elif dtype in _INT_RANGES:
        r = _INT_RANGES[dtype]
        if type(value) is not int:
            c.fail(field, value, f"must be an integer (an {dtype} leaf)")
        if not r.min <= value <= r.max:
            c.fail(field, value, f"must be in the {dtype} range [{r.min}, {r.max}]")
    elif not (type(value) in (int, float) or value in _NON_FINITE):  # a list is never "in"
        c.fail(field, value, f"must be a number (or one of {list(_NON_FINITE)}) (a {dtype} leaf)")
    rule = _SCALAR_RULES.get(name.rsplit("/", 1)[-1])
    if rule is not None:
        ok, need = rule
        number = value if type(value) is int else float(value)  # "nan" etc. fail every range
        if not ok(number):
            c.fail(field, value, need)


def _validate_loss_scale(c: _Fields, saved: dict) -> None:
    c.string("loss_scale.policy", c.get(saved, "policy", "loss_scale"))
    scale = c.get(saved, "scale", "loss_scale")
    if type(scale) not in (int, float) or not 0 < scale < math.inf:
        c.fail("loss_scale.scale", scale, "must be a finite number > 0")
    for name in LossScaleState._fields[1:]:
        if name in saved:  # a field this checkpoint lacks keeps the engine's fresh value
            c.integer(f"loss_scale.{name}", saved[name], hi=_INT32_MAX)
    dtypes = c.mapping("loss_scale.dtypes", c.get(saved, "dtypes", "loss_scale"))
    for name, dtype in dtypes.items():
        c.dtype(f"loss_scale.dtypes[{name!r}]", dtype)


def _validate_files(c: _Fields, files: list, world_size: int, numel: int) -> None:
    if len(files) != world_size:
        c.fail("files", f"{len(files)} entries", f"must list one file per rank (world_size {world_size})")
    ranges = []
    for r, entry in enumerate(files):
        f = f"files[{r}]"
        c.mapping(f, entry)
        name = c.string(f"{f}.file", c.get(entry, "file", f))
        if os.path.basename(name) != name or name.startswith(".") or not name.endswith(".safetensors"):
            c.fail(f"{f}.file", name, "must be a plain *.safetensors file name")
        c.integer(f"{f}.rank", c.get(entry, "rank", f), lo=r, hi=r)
        for j, seg in enumerate(c.sequence(f"{f}.segments", c.get(entry, "segments", f))):
            if not isinstance(seg, list) or len(seg) != 2:
                c.fail(f"{f}.segments[{j}]", seg, "must be a pair [g0, g1]")
            g0 = c.integer(f"{f}.segments[{j}][0]", seg[0], hi=numel)
            c.integer(f"{f}.segments[{j}][1]", seg[1], lo=g0 + 1, hi=numel)
            ranges.append((seg[0], seg[1]))
        c.integer(f"{f}.bytes", c.get(entry, "bytes", f))
        c.string(f"{f}.sha256", c.get(entry, "sha256", f), _SHA256)
    end = 0
    for g0, g1 in sorted(ranges):
        if g0 != end:
            c.fail("files[*].segments", [g0, g1], f"the files' ranges must tile [0, {numel}) (gap or overlap at {end})")
        end = g1
    if end != numel:
        c.fail("files[*].segments", end, f"the files' ranges must cover all {numel} elements")


def _validate_engine_fit(manifest: dict, engine: Engine, file: str) -> None:
    """What only this engine can judge: its dynamic loss scale's range."""
    policy, scale = engine.loss_scale, manifest["loss_scale"]["scale"]
    if isinstance(policy, DynamicLossScale) and not policy.min_scale <= scale <= policy.max_scale:
        _Fields(file).fail(
            "loss_scale.scale", scale,
            f"must be in [min_scale, max_scale] = [{policy.min_scale}, {policy.max_scale}] of this engine's DynamicLossScale",
        )


# ================================================================================== commit protocol
# ---------------------------------------------------------------------------------- pointer and marker
def _write_atomic(directory: str, name: str, data: bytes, hook: Callable = _no_hook, point: str | None = None) -> None:
    """Replace ``directory/name`` by ``data`` atomically: write ``.<name>.tmp-<id>``, fsync it,
    ``os.replace`` it onto ``name``, fsync the directory."""
    tmp = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if point is not None:
            hook(point, file=tmp)
        os.replace(tmp, os.path.join(directory, name))
    except Exception:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def _read_small_json(file: str, kind: str, format: str) -> tuple[dict, _Fields]:
    with open(file, "rb") as f:
        obj = _parse_json(f.read(), file)
    if not isinstance(obj, dict) or obj.get("format") != format:
        raise CheckpointError(f"{file} is not an fzero checkpoint {kind}")
    if obj.get("version") != VERSION:
        raise CheckpointError(f"{file} has format version {obj.get('version')!r}; this fzero reads version {VERSION}")
    return obj, _Fields(file, kind)


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


def _write_shard(directory, rank, world_size, names, leaves, kinds, segments, hook: Callable) -> dict:
    """Step 2, every rank: its shard file in the snapshot directory; its manifest entry."""
    _need_safetensors()
    fname = f"shard-{rank:05d}-of-{world_size:05d}.safetensors"
    file = os.path.join(directory, fname)
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
    hook("shard_written", file=file, rank=rank)
    sha, size = _sha256(file, fsync=True)
    _fsync_dir(directory)
    return {"file": fname, "rank": rank, "segments": [[g0, g1] for g0, g1, _ in segments], "bytes": size, "sha256": sha}


def _write_manifest(directory: str, manifest: dict, hook: Callable) -> str:
    """Step 3, rank 0: validate the manifest as ``load`` will, write and fsync it; its sha256."""
    file = os.path.join(directory, MANIFEST)
    data = _dump_json(manifest)
    _validate_manifest(_parse_json(data, file), file)
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
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


def _check_save_args(params, state, scaler_state, layout: Layout, extra) -> tuple:
    if not isinstance(state, ZeroState):
        raise CheckpointError(f"state must be the ZeroState from engine.init/step, got {type(state).__name__}")
    if optree.tree_structure(params) != layout.treespec:
        raise CheckpointError("params do not have the structure the engine was initialized with")
    if not isinstance(scaler_state, LossScaleState):
        raise CheckpointError(f"scaler_state must be the LossScaleState from engine.init/step, got {type(scaler_state).__name__}")
    names, leaves, _ = leaf_paths(state)
    kinds = _classify(names, leaves, layout.shard_numel)
    return names, leaves, kinds, _extra_json(extra)


def save(path, params: Any, state: ZeroState, scaler_state: LossScaleState, engine: Engine, *,
         extra: dict | None = None, _hook: Callable = _no_hook) -> None:
    """Save a checkpoint of ``(state, scaler_state)`` to the directory ``path``; collective.

    Writes a new snapshot directory inside ``path`` (each rank the real elements of its own
    shard of every ``[S]`` state leaf, one safetensors file per rank, in parallel; rank 0 then
    ``manifest.json``: layout, 0-d leaves, loss-scale state, ``extra``, sha256 of each file),
    then atomically points ``path/current.json`` at it and deletes the snapshots older than the
    previous one (see the module docstring). A crash at any point leaves the previous checkpoint
    loadable. ``path`` may be missing, an empty directory or an fzero checkpoint directory;
    anything else raises ``CheckpointError``. ``params`` are not stored (they are the master cast
    to ``param_dtype``); they are checked against the layout. ``extra``: a small dict of strict
    JSON (no NaN or infinity; rank 0's is saved), e.g. the data loader's position.
    """
    layout, comm = _ready(engine)
    path = os.path.abspath(os.fspath(path))
    rank, n, what = comm.rank, comm.world_size, f"save {path}"
    names, leaves, kinds, extra_text = _agree(comm, what, lambda: _check_save_args(params, state, scaler_state, layout, extra))
    snapshot = _agree(comm, what, lambda: _begin(path, _hook) if rank == 0 else None, gather=True)[0]
    directory, committed = os.path.join(path, snapshot), []
    try:
        segments = _rank_segments(layout)[rank]
        files = _agree(comm, what, lambda: _write_shard(directory, rank, n, names, leaves, kinds, segments, _hook), gather=True)

        def finish():
            if rank == 0:
                manifest = _manifest(layout, engine, names, leaves, kinds, scaler_state, extra_text, files)
                digest = _write_manifest(directory, manifest, _hook)
                _commit(path, snapshot, digest, _hook)
                committed.append(snapshot)

        _agree(comm, what, finish)
    except CheckpointError:
        if rank == 0 and not committed:  # the pointer still names the previous snapshot
            shutil.rmtree(directory, ignore_errors=True)
        raise


# ================================================================================== reading and resharding
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


def read_manifest(path) -> dict:
    """The parsed, validated manifest of the checkpoint at ``path`` (the snapshot its
    ``current.json`` names); no process group needed."""
    path = os.path.abspath(os.fspath(path))
    return _read_snapshot_manifest(path, *_resolve(path))


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


def _check_files(manifest: dict, path: str, snapshot: str) -> None:
    """Every listed file exists with its recorded size (their ranges were validated)."""
    for entry in manifest["files"]:
        file = os.path.join(path, snapshot, entry["file"])
        try:
            size = os.path.getsize(file)
        except FileNotFoundError:
            raise _vanished(path, snapshot, file, "shard file") from None
        if size != entry["bytes"]:
            raise CheckpointError(f"shard file {file} has {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)")


def _open_snapshot(path: str, snapshot: str, digest: str, engine: Engine, layout: Layout) -> tuple[dict, _Template]:
    """Every rank: the snapshot's manifest, checked against this engine; the state to fill."""
    manifest = _read_snapshot_manifest(path, snapshot, digest)
    where = os.path.join(path, snapshot, MANIFEST)
    state, scaler = engine.state_like()
    names, leaves, spec = leaf_paths(state)
    template = _Template(state, scaler, names, leaves, spec, _classify(names, leaves, layout.shard_numel))
    _validate_engine_fit(manifest, engine, where)
    _check_model(manifest, layout, where)
    _check_state(manifest, names, leaves, template.kinds, where)
    _check_files(manifest, path, snapshot)
    return manifest, template


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


def _check_sums(path: str, snapshot: str, files: list, new_segments: list, rank: int) -> None:
    """The files this rank hashes (``_verifiers``) match the manifest's sha256."""
    for entry, owner in zip(files, _verifiers(files, new_segments)):
        if owner != rank:
            continue
        file = os.path.join(path, snapshot, entry["file"])
        try:
            sha, _ = _sha256(file)
        except FileNotFoundError:
            raise _vanished(path, snapshot, file, "shard file") from None
        if sha != entry["sha256"]:
            raise CheckpointError(f"shard file {file} is corrupted: sha256 {sha} but the manifest says {entry['sha256']}")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    x, y = a.item(), b.item()
    return x == y or (x != x and y != y)  # nan == nan here


def _first_leaves(manifest: dict, t: _Template, hyperparams: str) -> tuple[list, list]:
    """The 0-d leaves (hyperparameters from the engine or the checkpoint, the rest from the
    checkpoint) and zeroed ``[S]`` buffers to read into; ``[(name, saved, engine)]`` for every
    hyperparameter whose values differ."""
    saved = {e["name"]: e for e in manifest["state"]}
    hyper = _hyperparam_ids(t.state)
    out, differ, seen = [], [], set()
    for name, leaf, kind in zip(t.names, t.leaves, t.kinds):
        if kind == "shard":  # fill the template's own buffers (no second copy of the state), padding zero
            if leaf.untyped_storage().data_ptr() in seen:
                leaf = torch.empty_like(leaf)
            seen.add(leaf.untyped_storage().data_ptr())
            out.append(leaf.detach().zero_())
            continue
        value = _from_json_value(saved[name]["value"], leaf.dtype, leaf.device)
        if id(leaf) in hyper:
            if not _same(value, leaf):
                differ.append((name, value.item(), leaf.item()))
            if hyperparams == "engine":
                value = leaf
        out.append(value)
    return out, differ


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


def _read_state(path, snapshot, manifest, t: _Template, segments, engine, hyperparams) -> tuple:
    """Every rank: its leaves of the state, the loss-scale state, the differing hyperparameters."""
    out, differ = _first_leaves(manifest, t, hyperparams)
    for entry in manifest["files"]:
        pieces = _overlaps(entry["segments"], segments)
        if pieces:
            _read_file(path, snapshot, entry, pieces, t, out)
    return out, _restore_scaler(manifest["loss_scale"], t.scaler, engine), differ


def load(path, engine: Engine, *, verify: bool = True, hyperparams: str = "engine", _hook: Callable = _no_hook):
    """Load the checkpoint at ``path`` into ``engine``'s layout; collective.

    ``engine`` must have been ``init``-ed with params of the same model (a fresh init is fine),
    at any world size, alignment or bucketing. Returns new ``(params, state, scaler_state,
    extra)``: the state holds this rank's shard of the saved global master/moments/masks and
    the saved 0-d leaves; ``params`` are the all-gather of the master cast to the engine's
    ``param_dtype``. The loss-scale state is restored, except that a static (or no) loss
    scale keeps the engine's own fixed scale.

    ``hyperparams``: where the hyperparameters come from -- the 0-d state leaves named in a
    state NamedTuple's ``HYPERPARAMS`` (``lr``, ``b1``, ``b2``, ``eps``, ``weight_decay``,
    ``max_norm``, ``momentum``; see ``transforms.get_hyperparams``). ``"engine"`` (default):
    the engine's own, i.e. the values its transform was built with, so a resumed run uses the
    hyperparameters its code gives; one ``UserWarning`` (on rank 0) lists every one that differs
    from the checkpoint's (name, checkpoint value, engine value). ``"checkpoint"``: the saved
    ones (including values changed with ``transforms.set_hyperparams`` during training). Any
    other value raises ``ValueError``. Counts, moments, masks and the master always come from
    the checkpoint.

    Every rank reads the snapshot that ``path/current.json`` named when rank 0 read it, so the
    result is one save's, even while another process saves to ``path``; if that snapshot is
    deleted before the load is done (two later saves), ``CheckpointError`` ("replaced while
    loading"). A manifest with a value out of its range or type raises ``CheckpointError``
    naming the field.

    ``verify``: check the sha256 of every shard file first, each file hashed by one rank (the
    one that reads most of it). Each rank then reads only the element ranges of the old files
    that overlap its new shard.
    """
    if hyperparams not in HYPERPARAMS_FROM:
        raise ValueError(f"hyperparams must be one of {HYPERPARAMS_FROM}, got {hyperparams!r}")
    _need_safetensors()
    layout, comm = _ready(engine)
    path = os.path.abspath(os.fspath(path))
    rank, what = comm.rank, f"load {path}"
    snapshot, digest = _agree(comm, what, lambda: _resolve(path) if rank == 0 else None, gather=True)[0]
    _hook("resolved", snapshot=snapshot)
    manifest, t = _agree(comm, what, lambda: _open_snapshot(path, snapshot, digest, engine, layout))
    segments = _rank_segments(layout)
    if verify:
        _agree(comm, what, lambda: _check_sums(path, snapshot, manifest["files"], segments, rank))
    _hook("verified", snapshot=snapshot)
    leaves, scaler, differ = _agree(
        comm, what, lambda: _read_state(path, snapshot, manifest, t, segments[rank], engine, hyperparams)
    )
    if differ and hyperparams == "engine" and rank == 0:
        listed = "; ".join(f"{name}: checkpoint {saved!r}, engine {mine!r}" for name, saved, mine in differ)
        warnings.warn(f"load {path}: hyperparameters differ from the checkpoint's, the engine's take effect "
                      f"(load(..., hyperparams=\"checkpoint\") restores the saved ones): {listed}", stacklevel=2)
    state = t.spec.unflatten(leaves)
    with torch.no_grad():
        shard = cast_params(state.master, engine.param_dtype, copy=True).to(engine.device)
        params = unflatten(comm.all_gather(shard, layout), layout)
    return params, state, scaler, manifest["extra"]


# ================================================================================== export
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
