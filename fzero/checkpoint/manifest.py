"""The manifest (``manifest.json`` of a snapshot): everything but the tensor bytes, as strict JSON.

Fields::

    format, version            "fzero-checkpoint", 2
    world_size, param_dtype    of the save
    step                       extra["step"] if the save's ``extra`` has one (an integer >= 0), else null
    layout                     numel (P); leaves: [{path, shape, offset}], offset in the global [P]
                               vector; saved_with: {world_size, alignment, shard_numel, buckets}
    state                      [{name, kind ("shard" | "scalar" | "replicated"), dtype, value (scalars
                               only), shape (replicated only)}]
    loss_scale                 policy (its repr), the LossScaleState fields, their dtypes
    extra                      the caller's dict
    files                      one per rank: {file, rank, segments [[g0, g1], ...], bytes, sha256}
    torch_version

0-d values are JSON numbers of their dtype (float64 values round-trip through JSON bit for bit);
a non-finite float is written as the string ``"inf"``, ``"-inf"`` or ``"nan"``.

**Validation.** Manifest, pointer and marker are parsed strictly (no ``NaN``/``Infinity``
tokens, no out-of-range numbers, no duplicate keys: :mod:`fzero.checkpoint.strict_json`), and
every value of the manifest is checked before use (:func:`validate_manifest`): types (integers
are JSON integers, 0-d values JSON numbers of their dtype, dtypes known names), counts >= 0, the
loss scale finite and > 0 (and for a ``DynamicLossScale`` engine within its ``[min_scale,
max_scale]``), the built-in hyperparameters in the ranges their transforms accept
(``transforms.hyperparams.HYPERPARAM_RULES``), ``extra.step``, if any, an integer equal to ``step``. A
bad value raises ``CheckpointError`` naming the field. ``save`` validates the manifest it is about
to write the same way; ``extra`` must be strict JSON (no NaN or infinity) nested at most
``MAX_DEPTH - 1`` deep.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Callable

import torch

from fzero.transforms.hyperparams import HYPERPARAM_RULES
from fzero.transforms.tree import leaf_paths

from ..layout import Layout
from ..scaler import LossScaleState
from .form import replicated
from .strict_json import (
    DTYPES, MAX_DEPTH, VERSION, CheckpointError, Fields, check_header, dtype_name, json_value, nested_too_deep, non_finite,
)

__all__ = ["FORMAT", "MANIFEST", "SHA256", "classify", "state_leaves", "extra_json", "build_manifest", "validate_manifest"]

FORMAT = "fzero-checkpoint"  # the manifest's and the pointer's "format"
MANIFEST = "manifest.json"  # its name in a snapshot directory

SHA256 = re.compile(r"[0-9a-f]{64}")  # a sha256 as the manifest and the pointer write it
_INT_RANGES = {n: torch.iinfo(d) for n, d in DTYPES.items() if not d.is_floating_point and d != torch.bool}
_INT32_MAX = torch.iinfo(torch.int32).max


# ---------------------------------------------------------------------------------- building
def state_leaves(state: Any, shard_numel: int) -> tuple[list[str], list, Any, list[str]]:
    """``state``, as a checkpoint holds it (``fzero.checkpoint.form.saved_form``), flattened:
    ``(names, leaves, treespec, kinds)``, each leaf's kind as ``classify`` says."""
    names, leaves, spec = leaf_paths(state)
    return names, leaves, spec, classify(names, leaves, shard_numel, replicated(state))


def classify(names, leaves, shard_numel: int, whole: frozenset) -> list[str]:
    """The kind of each state leaf: ``"shard"`` (``[S]``), ``"scalar"`` (0-d) or, for a leaf whose
    ``id`` is in ``whole`` (``fzero.checkpoint.form.replicated``: held whole and alike by every
    rank, Adafactor's statistics), ``"replicated"``, any shape: rank 0 stores it once; nothing
    else can be stored."""
    kinds = []
    for name, leaf in zip(names, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise CheckpointError(f"state leaf {name!r} is a {type(leaf).__name__}, not a tensor; cannot checkpoint it")
        if id(leaf) in whole:
            kinds.append("replicated")
        elif leaf.ndim == 0:
            kinds.append("scalar")
        elif leaf.ndim == 1 and leaf.shape[0] == shard_numel:
            kinds.append("shard")
        else:
            raise CheckpointError(
                f"state leaf {name!r} has shape {tuple(leaf.shape)}: only [S]={shard_numel}-element shards, "
                "0-d tensors and statistics every rank holds alike (transforms.adafactor's) can be checkpointed"
            )
        if dtype_name(leaf.dtype) not in DTYPES:
            raise CheckpointError(f"state leaf {name!r} has unsupported dtype {leaf.dtype}")
    return kinds


def extra_json(extra: Any) -> str:
    """``extra`` as strict JSON text; CheckpointError naming the key of a NaN/infinity, or a
    ``"step"`` that is not an integer >= 0 (it becomes the manifest's ``step``), or for an
    ``extra`` nested deeper than a load reads (the manifest holds it one level below
    ``MAX_DEPTH``)."""
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise CheckpointError(f"extra must be a dict or None, got {type(extra).__name__}")
    found = text = None
    try:
        found = non_finite(extra, "extra")
        text = None if found else json.dumps(extra, allow_nan=False)
    except RecursionError:  # nested too deep: refused below
        pass
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra is not JSON serializable: {e}") from e
    if found:
        where, value = found
        raise CheckpointError(f"{where} = {value!r}: JSON has no NaN or infinity; store it as a string or None")
    if text is None or nested_too_deep(text, MAX_DEPTH - 1):
        raise CheckpointError(f"extra nests lists or dicts more than {MAX_DEPTH - 1} deep: a load refuses a manifest "
                              f"nested more than {MAX_DEPTH} deep")
    step = extra.get("step", 0)
    if type(step) is not int or step < 0:  # not a bool, not 3.0
        raise CheckpointError(f"extra['step'] = {step!r}: must be an integer >= 0 (the checkpoint's step)")
    return text


def build_manifest(layout: Layout, engine, names, leaves, kinds, scaler_state, extra_text: str, files: list) -> dict:
    """The manifest of a save: ``names``/``leaves``/``kinds`` of the state (:func:`classify`),
    ``extra_text`` from :func:`extra_json`, ``files``: each rank's shard file entry."""
    state_table = []
    for name, leaf, kind in zip(names, leaves, kinds):
        entry = {"name": name, "kind": kind, "dtype": dtype_name(leaf.dtype)}
        if kind == "scalar":
            entry["value"] = json_value(leaf)
        elif kind == "replicated":
            entry["shape"] = list(leaf.shape)
        state_table.append(entry)
    scale_names = list(LossScaleState._fields)
    extra = json.loads(extra_text)
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": layout.world_size,
        "param_dtype": dtype_name(engine.param_dtype),
        "step": extra.get("step"),
        "layout": {
            "numel": layout.numel,
            "leaves": [{"path": p, "shape": list(s), "offset": g}
                       for p, s, g in zip(layout.paths, layout.shapes, layout.global_offsets)],
            "saved_with": {"world_size": layout.world_size, "alignment": layout.alignment,
                           "shard_numel": layout.shard_numel, "buckets": len(layout.buckets)},
        },
        "state": state_table,
        "loss_scale": {
            "policy": repr(engine.loss_scale),
            **{k: json_value(v) for k, v in zip(scale_names, scaler_state)},
            "dtypes": {k: dtype_name(v.dtype) for k, v in zip(scale_names, scaler_state)},
        },
        "extra": extra,
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


def validate_manifest(m: Any, file: str) -> dict:
    """Every field of a parsed manifest, or CheckpointError naming the first bad one."""
    c = check_header(m, file, "manifest", FORMAT)
    n = c.integer("world_size", c.get(m, "world_size"), lo=1)
    c.dtype("param_dtype", c.get(m, "param_dtype"), floating=True)
    if c.get(m, "step") is not None:
        c.integer("step", m["step"])
    numel = _validate_layout(c, c.mapping("layout", c.get(m, "layout")))
    _validate_state(c, c.sequence("state", c.get(m, "state")))
    _validate_loss_scale(c, c.mapping("loss_scale", c.get(m, "loss_scale")))
    extra = c.mapping("extra", c.get(m, "extra"))
    if "step" in extra:  # a save checks it (extra_json); a resume reads it
        c.integer("extra.step", extra["step"])
    if extra.get("step") != m["step"]:
        c.fail("step", m["step"], f"must be extra.step ({extra.get('step')!r}), as a save writes it")
    _validate_files(c, c.sequence("files", c.get(m, "files")), n, numel)
    if "torch_version" in m:
        c.string("torch_version", m["torch_version"])
    return m


def _validate_layout(c: Fields, layout: dict) -> int:
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


def _validate_state(c: Fields, state: list) -> None:
    seen = set()
    for i, entry in enumerate(state):
        c.mapping(f"state[{i}]", entry)
        name = c.string(f"state[{i}].name", c.get(entry, "name", f"state[{i}]"))
        f = f"state[{name!r}]"
        if name in seen:
            c.fail(f"state[{i}].name", name, "must be unique")
        seen.add(name)
        kind = c.choice(f"{f}.kind", c.get(entry, "kind", f), ("scalar", "shard", "replicated"))
        dtype = c.dtype(f"{f}.dtype", c.get(entry, "dtype", f))
        if kind == "scalar":
            _validate_scalar(c, f"{f}.value", c.get(entry, "value", f), dtype, name)
        elif kind == "replicated":
            for j, size in enumerate(c.sequence(f"{f}.shape", c.get(entry, "shape", f))):
                c.integer(f"{f}.shape[{j}]", size)


def _validate_scalar(c: Fields, field: str, value: Any, dtype: str, name: str) -> None:
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


def _validate_loss_scale(c: Fields, saved: dict) -> None:
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


def _validate_files(c: Fields, files: list, world_size: int, numel: int) -> None:
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
        c.string(f"{f}.sha256", c.get(entry, "sha256", f), SHA256)
    end = 0
    for g0, g1 in sorted(ranges):
        if g0 != end:
            c.fail("files[*].segments", [g0, g1], f"the files' ranges must tile [0, {numel}) (gap or overlap at {end})")
        end = g1
    if end != numel:
        c.fail("files[*].segments", end, f"the files' ranges must cover all {numel} elements")

