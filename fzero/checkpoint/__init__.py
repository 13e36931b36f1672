"""Sharded checkpoints that survive crashes, never mix two saves, and load at any world size.

API (every function but ``read_manifest`` is collective: call it on every rank of the engine's
group)::

    save(path, params, state, scaler_state, engine, *, extra=None) -> None
    async_save(path, params, state, scaler_state, engine, *, extra=None) -> Future  # written in the background
    load(path, engine, *, verify=True, hyperparams="engine") -> (params, state, scaler_state, extra)
    export_full(path, params_or_state, engine) -> None
    full_master(params, state, engine) -> pytree     # the whole FP32 master, in memory on every rank
    read_manifest(path) -> dict                      # any process, no group needed
    recover(path, snapshot=None) -> str              # one process: re-point a lost/damaged pointer

A checkpoint is a directory of immutable snapshots and a pointer to the current one; a save
writes a new snapshot, then commits it by atomically replacing the pointer (the protocol, and
what a crash at each point leaves: :mod:`fzero.checkpoint.commit`); saves to one path exclude
each other (:mod:`fzero.checkpoint.lock`). A snapshot holds one safetensors file per rank and
``manifest.json`` (:mod:`fzero.checkpoint.manifest`). Each rank's file holds the real elements
of its shard in *global* coordinates -- ranges of the params' leaves concatenated in tree
order, without padding -- so a load at any world size, alignment or bucketing checks the
snapshot against its engine (:mod:`fzero.checkpoint.snapshot`), then reads, from each old file,
only the ranges its new shard needs (:mod:`fzero.checkpoint.reshard`). The manifest, the pointer
and the marker are small strict JSON files, checked field by field when read
(:mod:`fzero.checkpoint.strict_json`).

0-d leaves (step counts, hyperparameters, the loss-scale state) are identical on every rank;
rank 0's values are stored in the manifest as exact JSON numbers with their dtype. Params are
not stored: they are the all-gather of the master cast to ``param_dtype`` -- exactly what every
step computes -- so ``load`` rebuilds them bit for bit. The manifest's ``step`` is
``extra["step"]`` when the save was given one.

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
  checksums) and the commit protocol; no tensor bytes are in a home-made format.

**Errors are agreed**: a phase that fails on some ranks raises the same ``CheckpointError`` on
every rank, naming them (:mod:`fzero.checkpoint.collective`). ``export_full``: :mod:`fzero.checkpoint.export`.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable

import torch

from .. import lineage
from ..engine import Engine, ZeroState, cast_params
from ..flat import unflatten
from ..scaler import LossScaleState
from . import background, commit, files, lock, manifest, reshard, staging
from .collective import agree, error_text, ready
from .commit import need_safetensors, no_hook
from .export import EXPORT_FORMAT, export_full, full_master
from .form import engine_form, saved_form
from .manifest import FORMAT
from .snapshot import open_snapshot, read_snapshot_manifest, verify_snapshot
from .strict_json import VERSION, CheckpointError

__all__ = ["CheckpointError", "save", "async_save", "load", "export_full", "full_master", "read_manifest", "recover",
           "FORMAT", "VERSION"]

HYPERPARAMS_FROM = ("engine", "checkpoint")


def _check_save_args(path: str, params, state, scaler_state, engine: Engine, extra) -> tuple:
    """What ``save`` stores, checked: the state's leaves with its FP32 master, their kinds, the
    ``extra`` text. ``path``: where (a UTF-8 path); ``params``: the pytree or the flat buffer
    (``engine.flat_params``), as ``step`` takes them."""
    files.utf8(path)
    if not isinstance(state, ZeroState):
        raise CheckpointError(f"state must be the ZeroState from engine.init/step, got {type(state).__name__}")
    if not isinstance(scaler_state, LossScaleState):
        raise CheckpointError(f"scaler_state must be the LossScaleState from engine.init/step, got {type(scaler_state).__name__}")
    # the one place the params are used (checked as step checks them); master="remainder":
    # the FP32 master joined from this rank's shard of them and the remainder
    # (params edited since the step, or of another step with the remainder, raise here; so do
    # params written where no version counter saw it: ``lineage.checked_fp32_master``)
    saved = saved_form(lineage.checked_fp32_master(params, state, engine, where="checkpoint.save"), engine.shard_context)
    names, leaves, _, kinds = manifest.state_leaves(saved, engine.layout.shard_numel)
    return names, leaves, kinds, manifest.extra_json(extra)


def save(path, params: Any, state: ZeroState, scaler_state: LossScaleState, engine: Engine, *,
         extra: dict | None = None, _hook: Callable = no_hook) -> None:
    """Save a checkpoint of ``(state, scaler_state)`` to the directory ``path``; collective.

    Writes a new snapshot directory inside ``path`` (each rank the real elements of its own
    shard of every ``[S]`` state leaf, one safetensors file per rank, in parallel; rank 0 then
    ``manifest.json``: layout, 0-d leaves, loss-scale state, ``extra``, sha256 of each file),
    then atomically points ``path/current.json`` at it and deletes the snapshots older than the
    previous one (see :mod:`fzero.checkpoint.commit`). A crash at any point leaves the previous
    checkpoint loadable. ``path`` may be missing, an empty directory or an fzero checkpoint
    directory; anything else raises ``CheckpointError``. Saves to one path exclude each other:
    while one is in progress (in any process) another raises ``CheckpointError`` on every rank
    ("another save to ... is in progress", naming the holder's pid and host) and changes nothing.
    A save of the engine still in flight (:func:`async_save`) is waited for first.

    ``params``: the params pytree from ``init``/``step``, or its flat buffer
    (``engine.flat_params``), as ``step`` takes them -- of the same step as ``state``. They are
    not stored (they are the master cast to ``param_dtype``); with ``master="remainder"`` the
    FP32 master is rebuilt from them and the remainder (``engine.with_fp32_master``) and stored,
    so the checkpoint loads into either master mode. ``extra``: a small dict of strict JSON (no
    NaN or infinity; rank 0's is saved), e.g. the data loader's position; its ``"step"``, if
    any, must be an integer >= 0 and becomes the manifest's ``step``.
    """
    layout, comm = ready(engine, "save(path, params, state, scaler_state, engine)")
    background.wait_for(engine)
    comm.arrive("checkpoint.save", timeout=engine.call_timeout)
    path = files.absolute(path)
    contents, extra_text = agree(comm, f"save {path}", lambda: _contents(path, params, state, scaler_state, engine,
                                                                        extra, staging.borrowed))
    _write(path, contents, extra_text, engine, layout, comm, _hook)


def async_save(path, params: Any, state: ZeroState, scaler_state: LossScaleState, engine: Engine, *,
               extra: dict | None = None, writer_nice: int = 19, _hook: Callable = no_hook) -> background.SaveFuture:
    """:func:`save`, written in the background; collective. Returns a ``concurrent.futures.Future``.

    It returns once this rank's part of the snapshot is *staged*: copied into a host buffer
    (pinned on CUDA; allocated at the engine's first ``async_save`` and reused: one more copy of
    the rank's ``[S]`` state leaves, :mod:`fzero.checkpoint.staging`). The caller may then step
    at once, ``donate=True`` included: the snapshot is the state of the call, bit for bit. A
    writer thread writes it and commits it as ``save`` does, agreeing with the other ranks
    through the store, never through the engine's process group, so it cannot interleave with
    the training loop's collectives (:mod:`fzero.comm.store_exchange`).

    ``writer_nice``: the writer thread's CPU priority as a Unix nice value, 0 (the training's own)
    to 19 (the lowest, the default): the writer then runs on what the training leaves idle, so
    it slows the steps little even on a CPU whose every core trains, and its write takes longer
    there (docs/checkpoints.md has both measured). Linux only (per thread); elsewhere ignored.

    ``future.result()`` is ``None`` once the snapshot is committed, or raises the same
    ``CheckpointError`` on every rank. Errors in the arguments (as ``save`` checks them) raise
    at the call on the rank that made them, before anything is staged, and reach the other ranks'
    futures, naming that rank; a rank that does not make the call within the engine's
    ``call_timeout`` fails the others' futures, naming it. The engine's saves run one at a time,
    in call order: ``async_save`` and ``save`` first wait for the save in flight.
    ``fzero.shutdown()`` and the end of the interpreter wait for it too (an end through an
    uncaught exception at most ``call_timeout``); a failure nobody asked the future about is
    reported then, or at the engine's next save, with a ``RuntimeWarning``
    (:mod:`fzero.checkpoint.background`).
    """
    layout, comm = ready(engine, "async_save(path, params, state, scaler_state, engine)")
    writer = background.writer_of(engine)
    writer.wait()  # the save before it: committed first, and its staging buffer is free again
    path = files.absolute(path)
    what = f"save {path}"
    # No communication here, so that the call blocks training only for the staging: the ranks'
    # writers meet in the exchange, whose first round is this call's arrival and agreement.
    peers = writer.exchange(comm, first_timeout=engine.call_timeout)

    def stage(names, leaves, kinds, scaler, owned, whole):
        # the replicas of a hybrid mesh other than the first write no shard: they stage none (and
        # hold no reference to the state, which the next steps may free)
        return staging.staged(names, leaves, kinds, scaler, owned if comm.replica == 0 else [], whole, writer.buffer)

    try:
        if not (isinstance(writer_nice, int) and not isinstance(writer_nice, bool) and 0 <= writer_nice <= 19):
            raise ValueError(f"async_save: writer_nice must be an integer from 0 to 19, got {writer_nice!r}")
        contents, extra_text = _contents(path, params, state, scaler_state, engine, extra, stage)
    except Exception as e:
        peers.post((error_text(e), None))  # the other ranks' writers fail at once, naming this error
        raise

    def write() -> None:
        agree(peers, what, lambda: None)  # every rank staged (within the engine's call_timeout)
        _write(path, contents, extra_text, engine, layout, peers, _hook)

    return writer.submit(path, write, nice=writer_nice, timeout=engine.call_timeout)


def _contents(path, params, state, scaler_state, engine: Engine, extra, stage) -> tuple:
    """``(contents, extra_text)``: this rank's part of the snapshot, ``stage``-d
    (:mod:`fzero.checkpoint.staging`), and ``extra`` as JSON text; the arguments checked."""
    names, leaves, kinds, extra_text = _check_save_args(path, params, state, scaler_state, engine, extra)
    comm = engine.comm  # the first rank writes the leaves every rank holds alike
    return stage(names, leaves, kinds, scaler_state, engine.layout.owned(comm.rank), comm.rank == 0 and comm.replica == 0), \
        extra_text


def _write(path: str, contents: staging.Contents, extra_text: str, engine: Engine, layout, peers, hook: Callable) -> None:
    """The save's three agreed phases (:mod:`fzero.checkpoint.commit`): rank 0 takes the lock and
    begins a snapshot; every writing rank writes its shard file; rank 0 writes the manifest and
    commits. ``peers``: whom each phase agrees with -- the engine's communicator (``save``) or
    a :class:`StoreExchange` (``async_save``'s writer thread)."""
    rank, n, what = peers.rank, peers.world_size, f"save {path}"
    # With replicas (a hybrid mesh) the first replica's shard ranks write; the others only agree.
    writer = peers.replica == 0
    lead = writer and rank == 0
    held, committed = {}, []  # rank 0: the save lock and the new snapshot's name, once taken
    try:
        snapshot = agree(peers, what, lambda: commit.begin(path, held, hook) if lead else None, gather=True)[0]
        directory = os.path.join(path, snapshot)

        def write_shard():
            contents.ready()
            return commit.write_shard(directory, rank, n, contents, hook)

        shards = agree(peers, what, lambda: write_shard() if writer else None, gather=True)[:n]  # replica-major

        def finish():
            if lead:
                m = manifest.build_manifest(layout, engine, contents.names, contents.leaves, contents.kinds,
                                            contents.scaler, extra_text, shards)
                digest = commit.write_manifest(directory, m, hook)
                commit.commit_snapshot(path, snapshot, digest, hook, held["lock"])
                committed.append(snapshot)

        agree(peers, what, finish)
    except CheckpointError:
        if "snapshot" in held and not committed:  # the pointer still names the previous snapshot
            with contextlib.suppress(OSError, CheckpointError):  # (the next save retries; this error is the one)
                commit.remove_snapshot(path, held["snapshot"])
        raise
    finally:
        if "lock" in held:
            lock.release(held["lock"])


def load(path, engine: Engine, *, verify: bool = True, hyperparams: str = "engine", _hook: Callable = no_hook):
    """Load the checkpoint at ``path`` into ``engine``'s layout; collective.

    ``engine`` must have been ``init``-ed with params of the same model (a fresh init is fine),
    at any world size, alignment or bucketing. Returns new ``(params, state, scaler_state,
    extra)``: the state holds this rank's shard of the saved global master/moments and the
    saved 0-d leaves; ``params`` are the all-gather of the master cast to the engine's
    ``param_dtype``. The loss-scale state is restored, except that a static (or no) loss
    scale keeps the engine's own fixed scale.

    ``hyperparams``: where the optimizer's configuration comes from -- the 0-d state leaves
    named in a state NamedTuple's ``HYPERPARAMS`` (``lr``, ``b1``, ``b2``, ``eps``,
    ``weight_decay``, ``max_norm``, ``momentum``; see ``transforms.iter_hyperparams``) and the
    per-leaf masks (``MaskedState.mask``: ``weight_decay_mask``, ``transforms.masked``).
    ``"engine"`` (default): the engine's own, i.e. what its transform was built with, so a
    resumed run uses the configuration its code gives; one ``UserWarning`` (on rank 0) lists
    every hyperparameter that differs from the checkpoint's (name, checkpoint value, engine
    value) and every params leaf whose mask differs (``tx_state/1/mask[w]: checkpoint True,
    engine False``). ``"checkpoint"``: the saved ones (including values changed with
    ``transforms.set_hyperparams`` during training). Any other value raises ``ValueError``.
    Counts, moments and the master always come from the checkpoint.

    Every rank reads the snapshot that ``path/current.json`` named when rank 0 read it, so the
    result is one save's, even while another process saves to ``path``; if that snapshot is
    deleted before the load is done (two later saves), ``CheckpointError`` ("replaced while
    loading"). Ranks may reach the checkpoint by different paths (other mount points); ranks
    given different checkpoints (that snapshot is not under every rank's path) raise
    ``CheckpointError`` naming each rank's path. A missing or damaged ``current.json`` raises
    ``CheckpointError`` naming the snapshots that have a valid manifest (see :func:`recover`).
    A manifest with a value out of its range or type raises ``CheckpointError`` naming the field.

    A save of the engine still in flight (:func:`async_save`) is waited for first, so a load
    after an ``async_save`` to ``path`` reads that save's snapshot.

    ``verify``: check the sha256 of every shard file first, each file hashed by one rank (the
    one that reads most of it). Each rank then reads only the element ranges of the old files
    that overlap its new shard.
    """
    if hyperparams not in HYPERPARAMS_FROM:
        raise ValueError(f"hyperparams must be one of {HYPERPARAMS_FROM}, got {hyperparams!r}")
    need_safetensors()
    layout, comm = ready(engine, "load(path, engine)")
    background.wait_for(engine)  # an async_save of the engine in flight: committed (or failed) first
    comm.arrive("checkpoint.load", timeout=engine.call_timeout)
    path = files.absolute(path)
    rank, what = comm.rank, f"load {path}"
    given = agree(comm, what, lambda: (files.utf8(path), commit.resolve(path) if rank == 0 else None), gather=True)
    snapshot, digest = given[0][1]
    _same_checkpoint(path, [p for p, _ in given], snapshot, comm, what)
    _hook("resolved", snapshot=snapshot)
    m, t = agree(comm, what, lambda: open_snapshot(path, snapshot, digest, engine, layout))
    if verify:
        owned = [layout.owned(r) for r in range(layout.world_size)]
        agree(comm, what, lambda: reshard.check_sums(path, snapshot, m["files"], owned, rank))
    _hook("verified", snapshot=snapshot)
    leaves, scaler, differ, masks = agree(
        comm, what, lambda: reshard.read_state(path, snapshot, m, t, layout.owned(rank), engine, hyperparams)
    )
    if masks is not None:  # every rank's counts over its own elements (the first replica's: the others hold the same)
        masks = reshard.mask_differences(agree(comm, what, lambda: masks, gather=True)[: layout.world_size])
    items = [f"{name}: checkpoint {saved!r}, engine {mine!r}" for name, saved, mine in differ] + (masks or [])
    if items and hyperparams == "engine" and rank == 0 and comm.replica == 0:
        warnings.warn(f"load {path}: the optimizer's configuration (hyperparameters, masks) differs from the "
                      f"checkpoint's; the engine's takes effect (load(..., hyperparams=\"checkpoint\") restores the "
                      f"saved one): {'; '.join(items)}", stacklevel=2)
    # 8-bit moments quantized into this layout's blocks, partition groups compacted into its shards
    state = engine_form(t.spec.unflatten(leaves), t.engine_state, engine.shard_context)
    with torch.no_grad():
        shard = cast_params(state.master, engine.param_dtype, copy=True).to(engine.device)
        params = unflatten(comm.all_gather(shard, layout), layout)
    state = engine.stored(state, shard)  # what the engine's master storage keeps (the remainder: split)
    lineage.mark(params, state.master)
    return params, state, scaler, m["extra"]


def _same_checkpoint(path: str, paths: list[str], snapshot: str, comm, what: str) -> None:
    """Ranks given different paths (``path``: this rank's, ``paths``: every rank's) must all
    find ``snapshot``, the one rank 0 resolved, under theirs; else every rank raises naming
    each rank's path."""
    if len(set(paths)) == 1:
        return
    found = agree(comm, what, lambda: os.path.isdir(os.path.join(path, snapshot)), gather=True)
    if all(found):
        return  # one checkpoint reached by different paths (or an exact copy of it)
    by_path: dict[str, list[int]] = {}
    for r, p in enumerate(paths):
        by_path.setdefault(p, []).append(r)
    listed = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {p}" + ("" if found[rs[0]] else f" (has no {snapshot})")
        for p, rs in by_path.items()
    )
    raise CheckpointError(f"load: the ranks were given different checkpoints: {listed}; {snapshot} is the snapshot "
                          f"rank 0's {commit.POINTER} names. Give every rank the same path")


def read_manifest(path) -> dict:
    """The parsed, validated manifest of the checkpoint at ``path`` (the snapshot its
    ``current.json`` names); no process group needed."""
    path = files.utf8(files.absolute(path))
    return read_snapshot_manifest(path, *commit.resolve(path))


def recover(path, snapshot: str | None = None) -> str:
    """Point ``path/current.json`` at a verified snapshot, for a checkpoint whose pointer is
    missing or damaged (``load`` then names the snapshots it could use). Not collective: run it
    in one process (it takes the save lock: ``CheckpointError`` while a save is in progress).

    ``snapshot``: the name of a snapshot directory in ``path`` (``"snapshot-<32 hex>"``, as
    ``load``'s error lists them). ``None``: if ``current.json`` is intact (it parses and the
    manifest it names matches its sha256) nothing changes; else the newest snapshot (by its
    manifest's modification time) that passes verification. Verification: the manifest is
    valid and every shard file has the size and sha256 the manifest records (what
    ``load(verify=True)`` checks). The snapshot is recorded in the marker if it was not.
    Returns the snapshot's name; ``CheckpointError`` naming the file if it fails verification,
    or listing each candidate's failure if none passes.
    """
    path = files.utf8(files.absolute(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}: it does not exist or is not a directory")
    if snapshot is not None and not (commit.SNAPSHOT.fullmatch(snapshot)
                                     and files.check_entry(os.path.join(path, snapshot), directory=True)):
        raise CheckpointError(f"no snapshot {snapshot!r} in {path}")
    if snapshot is None and not commit.complete_snapshots(path):
        raise CheckpointError(f"no snapshot in {path} has a valid {manifest.MANIFEST}")
    commit.check_entries(path)  # before the lock (which creates its file if missing): refused, nothing changes
    fd = lock.acquire(path)
    try:
        if snapshot is None:
            try:  # intact: nothing to do
                current, digest = commit.read_pointer(path)
                read_snapshot_manifest(path, current, digest)
                return current
            except (OSError, CheckpointError):
                pass
            problems = []
            for name, _ in reversed(commit.complete_snapshots(path)):
                try:
                    digest = verify_snapshot(path, name)
                except CheckpointError as e:
                    problems.append(f"{name}: {e}")
                    continue
                snapshot = name
                break
            else:
                raise CheckpointError(f"no snapshot in {path} passes verification: {'; '.join(problems)}")
        else:
            digest = verify_snapshot(path, snapshot)
        recorded = commit.recorded_snapshots(path)
        lock.check(fd, path, "while recover ran; it changed nothing")
        if snapshot not in recorded:
            commit.write_marker(path, recorded + [snapshot])
        commit.write_pointer(path, snapshot, digest, no_hook)
        return snapshot
    finally:
        lock.release(fd)
