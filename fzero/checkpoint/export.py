"""``export_full``: one consolidated safetensors file of the params or the FP32 master, keyed by
leaf path (no shards, no manifest: for other tools and for ``nn.Module.load_state_dict``);
``full_master``: the same consolidated FP32 master, in memory on every rank."""
from __future__ import annotations

import os
import uuid

import optree
import torch

from fzero.transforms.tree import leaf_paths

from .. import lineage
from ..engine import Engine, ZeroState
from ..flat import unflatten
from ..layout import Layout
from . import commit, durable
from .collective import agree, ready
from .form import replicated, saved_form
from .strict_json import CheckpointError, dtype_name

__all__ = ["EXPORT_FORMAT", "export_full", "full_master"]

EXPORT_FORMAT = "fzero-export"  # the file's safetensors metadata "format"


def _check_params(params, layout: Layout) -> None:
    """``params`` have the tree structure the engine was initialized with."""
    if optree.tree_structure(params) != layout.treespec:
        raise CheckpointError("params do not have the structure the engine was initialized with")


def full_master(params, state: ZeroState, engine: Engine, *, where: str = "checkpoint.full_master"):
    """The whole FP32 master, a pytree like ``params`` (keyed by the same paths), on every rank:
    this rank's shard (``engine.with_fp32_master``: rebuilt exactly with ``master="remainder"``)
    all-gathered with every other rank's. Collective: call on every rank. ``params``: the
    params from ``init``/``step`` of the same step as ``state``; params written since
    (``fzero.lineage.checked_fp32_master``) and a state a donating step consumed raise, on
    every rank. ``where`` names the call the user made in errors (``fm.state_dict`` calls it)."""
    comm = ready(engine, "full_master(params, state, engine)")[1]
    comm.arrive(where, timeout=engine.call_timeout)
    full = agree(comm, where, lambda: lineage.checked_fp32_master(params, state, engine, where=where))
    return _gathered(full.master, engine)


def _check_state(state: ZeroState, engine: Engine) -> None:
    """``state`` may be exported: not consumed, and the params it was returned with (if they
    are alive) are still its master cast (``fzero.lineage.checked_fp32_master``)."""
    lineage.refuse_consumed(state, "checkpoint.export_full")
    params = lineage.params_of(state.master)
    if params is not None:
        lineage.checked_fp32_master(params, state, engine, where="checkpoint.export_full")


def _gathered(master: torch.Tensor, engine: Engine):
    """Every rank's ``[S]`` FP32 master shard gathered, as a pytree like the params."""
    with torch.no_grad():
        flat = engine.comm.all_gather(master.detach().to(engine.device), engine.layout)
    return unflatten(flat, engine.layout)


def export_full(path, params_or_state, engine: Engine, *, moments: bool = False) -> None:
    """Write one consolidated safetensors file at ``path``, keyed by leaf path
    (``"blocks/0/attn/qkv_w"``): the FP32 master weights when given the ``ZeroState`` (an
    all-gather: call on every rank), or the ``param_dtype`` params when given the params.
    Rank 0 writes it (to a temporary file, then an atomic rename); collective.

    ``moments`` (with the ``ZeroState``): also every floating ``[S]`` leaf of the transform
    state -- Adam's moments -- as FP32 (8-bit moments dequantized, BF16 ones widened), keyed by
    the state leaf's path and the params leaf's (``"tx_state/0/mu/blocks/0/attn/qkv_w"``), and
    every statistic each rank holds whole (Adafactor's rows and columns) keyed by its path
    (``"tx_state/moments/inner_states/factored/0/row"``).

    For an ``nn.Module`` (without ``moments``): ``module.load_state_dict({k.replace("/", "."): v
    for k, v in safetensors.torch.load_file(path).items()})``.

    Refused on every rank, with nothing written: a state that a donating step consumed
    (``donate=True``: it holds that step's values), and a state whose params -- the ones the
    engine last returned with it, while they are alive -- were written behind its back
    (``fzero.lineage.checked_fp32_master``: the file would hold the master without the write).
    """
    commit.need_safetensors()
    layout, comm = ready(engine, "export_full(path, params_or_state, engine)")
    comm.arrive("checkpoint.export_full", timeout=engine.call_timeout)
    path = os.path.abspath(os.fspath(path))
    keys = list(layout.paths)  # and, with moments, each moment's leaves after the master's
    if isinstance(params_or_state, ZeroState):
        master = params_or_state.master
        if master.dtype != torch.float32 or master.numel() == 0:  # the remainder; the params' (master="params")
            raise CheckpointError(f"state.master is {tuple(master.shape)} {master.dtype}, not the FP32 master (an engine "
                                  "with master='remainder' or 'params'?): "
                                  "export_full(path, engine.with_fp32_master(params, state), engine)")
        if master.shape != (layout.shard_numel,):
            raise CheckpointError(f"state.master has shape {tuple(master.shape)}, the layout needs ({layout.shard_numel},)")
        agree(comm, f"export_full {path}", lambda: _check_state(params_or_state, engine))
        leaves = optree.tree_leaves(_gathered(master, engine))
        kind = "master"
        if moments:
            kind = "master+moments"
            saved = saved_form(params_or_state.tx_state, engine.shard_context)
            whole = replicated(saved)
            names, shards, _ = leaf_paths(saved)
            for name, shard in zip(names, shards):
                if id(shard) in whole:  # every rank holds it whole (Adafactor's statistics)
                    leaves.append(shard.float())
                    keys.append(f"tx_state/{name}")
                elif shard.is_floating_point() and shard.shape == (layout.shard_numel,):
                    leaves += [x.float() for x in optree.tree_leaves(_gathered(shard, engine))]
                    keys += [f"tx_state/{name}/{p}" for p in layout.paths]
    else:
        if moments:
            raise CheckpointError("export_full(..., moments=True) needs the ZeroState (the moments are state), not the params")
        _check_params(params_or_state, layout)
        leaves = optree.tree_leaves(params_or_state)
        kind = "params"

    def write():
        if comm.rank != 0 or comm.replica != 0:
            return None
        tensors = {k: leaf.detach().to("cpu").clone().contiguous() for k, leaf in zip(keys, leaves)}
        meta = {"format": EXPORT_FORMAT, "kind": kind, "dtype": dtype_name(leaves[0].dtype)}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            commit.save_file(tensors, tmp, metadata=meta)
            durable.file_sha256(tmp, fsync=True)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        durable.fsync_dir(os.path.dirname(path))
        return None

    agree(comm, f"export_full {path}", write)
