"""The ZeRO mixed-precision engine: where layout, collectives, loss scale and transform meet.

Per rank, with P parameter elements, N ranks and S = padded P / N:

* ``params``: the user's pytree, leaves are ``param_dtype`` views of one flat ``[N*S]`` buffer
  (2P bytes for FP16/BF16), identical on every rank;
* ``state.master``: this rank's ``[S]`` FP32 master shard, plus the transform's state on it
  (AdamW: two more FP32 ``[S]`` moments) -- 12S bytes, never 12P (on the host with
  ``offload="cpu"``);
* ``scaler_state``: the 0-d loss-scale tensors.

The step is pure unless ``donate=True``: it returns new params/state and leaves its inputs
untouched.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from transforms.base import scalar

from . import backward, checks
from .comm import Comm, predivide_factor
from .flat import Layout, flatten_buckets, leaf_paths, make_layout, split_buckets, tree_shard, unflatten
from .scaler import DynamicLossScale, LossScaleState, NoLossScale, StaticLossScale

__all__ = ["ZeroState", "Accumulated", "Engine", "zero1", "cast_params"]

_AUTO = "auto"


class ZeroState(NamedTuple):
    """``master``: ``[S]`` FP32 master weights of this rank's shard. ``tx_state``: the
    transform's state, built on that shard (e.g. Adam's ``count``, ``mu [S]``, ``nu [S]``)."""

    master: torch.Tensor
    tx_state: Any


class Accumulated(NamedTuple):
    """Gradients summed over ``count`` micro-batches (see ``Engine.accumulate``).

    ``grads``: this rank's (scaled) grads summed over micro-batches: the FP32 flat ``[N*S]``
    buffer (stage 1 ``accumulate``, 4P bytes), or this rank's ``[S]`` shard already summed
    over ranks (stage 2 ``accumulate``, 4P/N bytes; or one micro-batch from
    ``grad_and_value``). ``count``: 0-d int32 number of micro-batches in the sum."""

    grads: torch.Tensor
    count: torch.Tensor


class Engine:
    """Built by :func:`zero1`. ``init`` fixes the flat layout (static metadata kept here);
    ``step`` is then a function of its arguments only."""

    def __init__(self, tx, *, param_dtype, loss_scale, group, reduce_dtype, alignment, bucket_bytes, stage,
                 offload, donate, chunk_numel, simulate):
        self.tx = tx
        self.param_dtype = checks.check_param_dtype(param_dtype)
        if loss_scale == _AUTO:
            loss_scale = DynamicLossScale() if param_dtype == torch.float16 else None
        self.loss_scale = loss_scale if loss_scale is not None else NoLossScale()
        if not isinstance(self.loss_scale, (DynamicLossScale, StaticLossScale)):
            raise TypeError(f"loss_scale must be DynamicLossScale, StaticLossScale or None, got {loss_scale!r}")
        if reduce_dtype not in (torch.float32, param_dtype):
            raise TypeError(f"reduce_dtype must be torch.float32 or the param_dtype {param_dtype}, got {reduce_dtype}")
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage}")
        if offload not in (None, "cpu"):
            raise ValueError(f"offload must be None or 'cpu', got {offload!r}")
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive or None, got {bucket_bytes}")
        self.reduce_dtype = reduce_dtype
        self.alignment = alignment
        self.bucket_numel = None if bucket_bytes is None else max(1, bucket_bytes // param_dtype.itemsize)
        self.stage = stage
        self.offload = offload
        self.donate = donate
        if chunk_numel is not None and chunk_numel <= 0:
            raise ValueError(f"chunk_numel must be positive or None, got {chunk_numel}")
        self.chunk_numel = chunk_numel
        self.comm = Comm.simulate(*simulate) if simulate is not None else Comm.of(group)
        self.layout: Layout | None = None
        self.device: torch.device | None = None  # where params and grads live
        self.state_device: torch.device | None = None  # where master and moments live

    # ------------------------------------------------------------------ init
    def init(self, params: Any) -> tuple[Any, ZeroState, LossScaleState]:
        """``params``: pytree of floating tensors (FP32 recommended), never modified.

        Returns ``(params, state, scaler_state)``: ``params`` are ``param_dtype`` views of one
        new flat buffer, assembled from every rank's master shard (so all ranks agree even if
        their inputs differed); ``state`` holds this rank's FP32 shard and the transform state.
        """
        checks.check_params(params)
        comm = self.comm
        layout = make_layout(params, comm.world_size, alignment=self.alignment, bucket_numel=self.bucket_numel)
        self.layout = layout
        self.device = optree.tree_leaves(params)[0].device
        self.state_device = torch.device("cpu") if self.offload else self.device
        with torch.no_grad():
            shard = tree_shard(params, layout, comm.rank, dtype=torch.float32)
            first_params = cast_params(shard, self.param_dtype, copy=True)
        master = self._to_state_device(shard)
        # Masks and the like refer to the params pytree; the transform sees only the flat shard.
        state = ZeroState(master, self.tx.init(master, tree=params, to_flat=self._mask_to_shard))
        # Before the first collective on tensors: ranks that differ in layout, dtypes, loss
        # scaling or transform would otherwise mix their tensors (or abort inside gloo/NCCL).
        comm.check_same("engine configuration", {**layout.table(), **self._config_table(state.tx_state)})
        self._tx_spec = optree.tree_structure(state.tx_state)
        self._tx_leaves = [(p, x.shape, x.dtype) for p, x in zip(*leaf_paths(state.tx_state)[:2])]
        with torch.no_grad():
            new_params = unflatten(comm.all_gather(first_params, layout), layout)
        return new_params, state, self.loss_scale.init(self.device)

    def _config_table(self, tx_state: Any) -> dict[str, str]:
        """The settings every rank must share besides the layout, as printable entries: dtypes,
        loss scaling, stage, offload and the transform's state (structure, each leaf's dtype and
        shape, and the value of each 0-d leaf: counts and hyperparameters; read once, at init)."""
        S = self.layout.shard_numel
        out = {
            "param_dtype": str(self.param_dtype),
            "reduce_dtype": str(self.reduce_dtype),
            "loss_scale": repr(self.loss_scale),
            "stage": str(self.stage),
            "offload": repr(self.offload),
            "transform state": str(optree.tree_structure(tx_state)),
        }
        for path, x in zip(*leaf_paths(tx_state)[:2]):
            if isinstance(x, torch.Tensor):
                what = "[S]" if x.shape == (S,) else repr(x.item()) if x.ndim == 0 else str(tuple(x.shape))
                out[f"transform leaf {path}"] = f"{what} {x.dtype}"
        return out

    def state_like(self) -> tuple[ZeroState, LossScaleState]:
        """A fresh ``(state, scaler_state)`` with the structure, dtypes and devices ``init``
        built: the template that ``fzero.checkpoint.load`` fills. Needs ``init`` first."""
        layout, _ = self._ready()
        master = self._to_state_device(torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.device))
        # the transform's init may look at the params' shapes (masks); values are not needed
        like = layout.treespec.unflatten([torch.zeros((), device=self.device).expand(s) for s in layout.shapes])
        state = ZeroState(master, self.tx.init(master, tree=like, to_flat=self._mask_to_shard))
        return state, self.loss_scale.init(self.device)

    def _to_state_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.state_device == self.device:
            return t
        t = t.to(self.state_device)
        # Pinned host memory makes the per-step host<->device copies asynchronous DMA.
        return t.pin_memory() if torch.cuda.is_available() else t

    def _mask_to_shard(self, mask: Any) -> torch.Tensor:
        """A pytree of bools (or bool tensors) shaped like the params -> this rank's ``[S]`` bool shard."""
        layout = self.layout
        try:
            leaves = layout.treespec.flatten_up_to(mask)
        except (ValueError, TypeError) as e:
            raise ValueError(f"mask structure differs from params: {e}") from None
        full = []
        for path, shape, m in zip(layout.paths, layout.shapes, leaves):
            m = torch.as_tensor(m, dtype=torch.bool, device=self.state_device)
            if m.ndim and m.shape != shape:
                raise ValueError(f"mask leaf {path!r} has shape {tuple(m.shape)}, expected {tuple(shape)} or a bool")
            full.append(m.expand(shape))
        return tree_shard(layout.treespec.unflatten(full), layout, self.comm.rank, dtype=torch.bool)

    # ------------------------------------------------------------------ step
    def step(self, params: Any, grads: Any, state: ZeroState, scaler_state: LossScaleState):
        """One optimizer step. ``params``: the pytree from ``init``/``step``, or its flat buffer
        (``flat_params``; the new params then come back flat too). ``grads`` are d(scaled
        loss)/d(params), this rank's: a pytree like params, the ``[N*S]`` grad of the flat
        buffer, or an ``Accumulated`` sum of micro-batches.

        reduce-scatter (sum) -> unscale and average -> one all-reduce of the squared norm
        (which carries found_inf) -> transform -> keep old values if not finite -> cast ->
        all-gather -> loss-scale update. Returns ``(params, state, scaler_state, info)``; ``info``
        holds 0-d tensors: ``found_inf`` (bool, agreed by all ranks), ``loss_scale`` (used this
        step), ``grad_norm`` (global L2 norm of the unscaled mean grads, before clipping) and
        ``scale_stuck`` (bool: overflows persist at the minimum scale, see ``fzero.scaler``;
        ``fzero.nonfinite_leaves(grads)`` then names the culprits, off the hot path).
        """
        layout, comm = self._ready()
        flat_in = self._check(params, "params")  # the flat buffer itself (flat_params) or the pytree
        self._check_state(state, scaler_state)
        scale = scaler_state.scale

        # 1. Sum over ranks, this rank's [S] shard only (see _reduce for the precision).
        g, pre, micro = self._reduce(grads)

        # 2. Average over ranks and micro-batches and unscale, in one FP32 multiply:
        #    mean grad = sum * pre / (N * micro * scale).
        g = g.float() * scalar(pre / comm.world_size / (scale * micro))

        # 3. One small all-reduce: the global sum of squares. Any inf/NaN on any rank makes it
        #    non-finite, so it doubles as the cross-rank found_inf agreement. Padding is zero.
        #    Squared and summed in float64: finite FP32 grads never overflow it (FP32 squares
        #    overflow above 1.8e19, which would pass for an inf).
        sumsq = comm.all_reduce_sum(torch.linalg.vector_norm(g, dtype=torch.float64).square())
        found_inf = ~torch.isfinite(sumsq)
        norm = torch.sqrt(sumsq)
        grad_norm = norm.float()

        # 4-6. Transform, skip if not finite, cast: on the FP32 shard (on the host with offload:
        #      a blocking copy there), in cache-sized chunks when eager (see _update).
        g, skip, norm = (x.to(self.state_device) for x in (g, found_inf, norm))
        master, tx_state, shard = self._update(g, state, skip, norm)

        # 7. Gather everyone's cast shard into the new flat param buffer.
        new_params = comm.all_gather(shard.to(self.device, non_blocking=True), layout)
        if not flat_in:
            new_params = unflatten(new_params, layout, like=params)

        scaler_state = self.loss_scale.update(scaler_state, found_inf)
        info = {
            "found_inf": found_inf,
            "loss_scale": scale,
            "grad_norm": grad_norm,
            "scale_stuck": self.loss_scale.stuck(scaler_state),
        }
        new_state = ZeroState(master, tx_state)
        if self.donate:  # write into the inputs' buffers: no allocation of state or params
            new_state = _write_into(state, new_state)
            new_params = _write_into(params, new_params)
        return new_params, new_state, scaler_state, info

    def _update_chunk(self, g, master, tx_state, skip, norm):
        """Steps 4-6 on (a chunk of) the shard: ``(master, tx_state, master in param_dtype)``."""
        updates, new_tx_state = self.tx.update(g, tx_state, master, grad_norm=norm)
        # Skip without a branch: on overflow every state tensor keeps its old bits.
        new_master = torch.where(skip, master, master + updates)
        new_tx_state = optree.tree_map(lambda new, old: torch.where(skip, old, new), new_tx_state, tx_state)
        return new_master, new_tx_state, cast_params(new_master, self.param_dtype)

    def _update(self, g, state: ZeroState, skip, norm):
        """``_update_chunk`` over the whole ``[S]`` shard.

        The transforms are elementwise on the shard (a rank holds arbitrary slices of params,
        so they must be; the one global quantity, the grad norm, comes in as ``norm``), so the
        shard may be cut into chunks. Eager, each op of the update allocates a temporary: at
        shard size those are fresh pages from the OS every op (924 vs 390 ms for 2e7 elements
        on a 2-core CPU); at ``chunk_numel`` they stay in cache and the allocator reuses them. The
        chunks write into full-size outputs -- the inputs' own buffers with ``donate`` -- and
        0-d state (the step count) is the same from every chunk. Compiled, inductor fuses the
        update into one loop, so it runs on the whole shard."""
        S = g.numel()
        chunk = self.chunk_numel if g.device.type == "cpu" else None  # CUDA: its caching allocator reuses memory
        if torch.compiler.is_compiling() or chunk is None or chunk >= S:
            return self._update_chunk(g, state.master, state.tx_state, skip, norm)
        is_shard = lambda x: isinstance(x, torch.Tensor) and x.shape == (S,)
        outs = None
        for lo in range(0, S, chunk):
            part = lambda x: x[lo : lo + chunk] if is_shard(x) else x
            res = self._update_chunk(g[lo : lo + chunk], state.master[lo : lo + chunk],
                                     optree.tree_map(part, state.tx_state), skip, norm)
            if outs is None:  # full-size outputs; 0-d leaves as the first chunk computed them
                full = lambda old, new: (old if self.donate else torch.empty_like(old)) if is_shard(old) else new
                outs = (full(state.master, res[0]), optree.tree_map(full, state.tx_state, res[1]),
                        torch.empty(S, dtype=self.param_dtype, device=g.device))
            for out, new in zip(optree.tree_leaves(outs), optree.tree_leaves(res)):
                if out.shape == (S,):
                    out[lo : lo + chunk].copy_(new)
        return outs

    def _grad_buckets(self, grads: Any, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's grads -- a pytree like params, or the flat buffer's grad -- checked and
        laid out as one ``[N*S_b]`` buffer per bucket in ``dtype``."""
        if self._check(grads, "grads"):  # d(loss)/d(flat buffer): already laid out, nothing to gather
            return [x.to(dtype) for x in split_buckets(grads, self.layout)]
        return flatten_buckets(grads, self.layout, dtype=dtype)

    def _pre(self) -> float:
        """The pre-division of a low-precision reduction (1 when reducing in FP32 or alone)."""
        n = self.comm.world_size
        return 1.0 if n == 1 or self.reduce_dtype == torch.float32 else predivide_factor(n)

    def _reduce_dtype(self) -> torch.dtype:
        return self.param_dtype if self.comm.world_size == 1 else self.reduce_dtype

    def _flat_to_reduce(self, grads: Any) -> tuple[list[torch.Tensor], float]:
        """``(buckets, pre)``: the grads as one buffer per bucket in the reduce dtype,
        pre-divided by ``pre``.

        Summing N scaled FP16 grads can overflow by itself: reduce in FP32 (default), or in
        the param dtype with FSDP's split of the 1/N (``pre`` ~ sqrt(N) before, the rest after).
        World size 1 reduces nothing: the grads keep their dtype and the step's FP32 cast fuses.
        """
        buckets, pre = self._grad_buckets(grads, self._reduce_dtype()), self._pre()
        return (buckets, pre) if pre == 1.0 else ([x / pre for x in buckets], pre)

    def _is_flat(self, grads: Any) -> bool:
        """Params or grads given as the flat ``[N*S]`` buffer (see ``flat_params``)."""
        return isinstance(grads, torch.Tensor) and grads.shape == (self.layout.padded_numel,)

    def _check(self, x: Any, what: str) -> bool:
        """Validate params or grads (``what``), given as the flat buffer or as a pytree like the
        params, against the layout, device and param dtype; return whether ``x`` is flat."""
        flat = self._is_flat(x)
        check = checks.check_flat if flat else checks.check_like_layout
        check(x, self.layout, what=what, device=self.device, dtype=self.param_dtype)
        return flat

    def _check_state(self, state: Any, scaler_state: Any) -> None:
        """``state``/``scaler_state`` must be what this engine's ``init``/``step`` returned: the
        master shard and every transform leaf of the shapes and dtypes ``init`` built (static
        facts only: no host sync, nothing traced)."""
        if not isinstance(state, ZeroState):
            raise TypeError(f"state must be the ZeroState from this engine's init/step, got {type(state).__name__}")
        if not isinstance(scaler_state, LossScaleState):
            raise TypeError(f"scaler_state must be the LossScaleState from this engine's init/step, "
                            f"got {type(scaler_state).__name__}")
        S, m = self.layout.shard_numel, state.master
        if not isinstance(m, torch.Tensor) or m.shape != (S,) or m.dtype != torch.float32:
            got = f"shape {tuple(m.shape)} {m.dtype}" if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"state.master is {got}, this engine's shard is ({S},) torch.float32: "
                             "the state of another engine (another model, world size or layout)?")
        paths, leaves, spec = leaf_paths(state.tx_state)
        # Dynamo cannot trace a PyTreeSpec comparison; compiled, the leaves are still checked.
        if len(leaves) != len(self._tx_leaves) or (not torch.compiler.is_compiling() and spec != self._tx_spec):
            raise ValueError(f"state.tx_state is {spec}, this engine's transform built {self._tx_spec}: "
                             "the state of another engine (another transform)?")
        for (path, shape, dtype), x in zip(self._tx_leaves, leaves):
            if not isinstance(x, torch.Tensor) or x.shape != shape or x.dtype != dtype:
                got = f"shape {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"state.tx_state leaf {path!r} is {got}, this engine's is shape {tuple(shape)} {dtype}: "
                                 "the state of another engine (another transform or layout)?")

    def _check_accumulated(self, acc: Accumulated) -> bool:
        """An ``Accumulated`` sum must be this rank's reduced ``[S]`` shard or the unreduced
        ``[N*S]`` flat grads of this engine's layout; return whether it is reduced."""
        S, full = self.layout.shard_numel, self.layout.padded_numel
        g = acc.grads
        if not isinstance(g, torch.Tensor) or g.shape not in ((S,), (full,)) or not g.is_floating_point():
            got = f"shape {tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(f"Accumulated grads are {got}; this engine takes a reduced shard ({S},) or unreduced "
                             f"flat grads ({full},), floating point: a sum from another engine?")
        if not isinstance(acc.count, torch.Tensor) or acc.count.ndim != 0:
            raise ValueError(f"Accumulated count must be a 0-d tensor, got {acc.count!r}")
        return g.shape == (S,)

    def flat_params(self, params: Any) -> torch.Tensor:
        """The ``[N*S]`` flat buffer that ``params``' leaves are views of.

        Differentiate with respect to it to get the grads already flat -- no per-leaf copy in
        the step -- and pass that tensor to ``step`` as ``grads``; pass the buffer itself as
        ``params`` to get the new flat buffer back (one copy with ``donate``, not one per leaf)::

            flat = engine.flat_params(params)
            grads = torch.func.grad(lambda f: loss_fn(fzero.unflatten(f, engine.layout), batch))(flat)
            flat, state, scaler_state, info = engine.step(flat, grads, state, scaler_state)

        With ``donate=True`` the buffer stays the same across steps."""
        layout, _ = self._ready()
        leaves = checks.check_like_layout(params, layout, what="params", device=self.device, dtype=self.param_dtype)
        storage = leaves[0].untyped_storage()
        start = leaves[0].storage_offset() - layout.offsets[0]
        if start < 0 or storage.nbytes() < (start + layout.padded_numel) * leaves[0].element_size() or any(
            x.untyped_storage().data_ptr() != storage.data_ptr() or x.storage_offset() != start + o
            for x, o in zip(leaves, layout.offsets)
        ):
            raise ValueError("params are not views of one flat buffer of this engine's layout (pass what init/step returned)")
        base = leaves[0]._base
        if base is not None and base.shape == (layout.padded_numel,) and base.storage_offset() == start:
            return base
        # e.g. a compiled step's output: the leaves share the buffer but carry no view link
        return leaves[0].new_empty(0).set_(storage, start, (layout.padded_numel,))

    def _reduce(self, grads: Any) -> tuple[torch.Tensor, float, Any]:
        """``(shard, pre, micro)``: this rank's ``[S]`` sum over ranks, its pre-division, and
        the number of micro-batches summed."""
        if isinstance(grads, Accumulated):
            if self._check_accumulated(grads):  # reduced already (stage 2, overlap)
                return grads.grads, self._pre(), grads.count
            return self.comm.reduce_scatter_sum(split_buckets(grads.grads, self.layout), self.layout), 1.0, grads.count
        flat, pre = self._flat_to_reduce(grads)
        return self.comm.reduce_scatter_sum(flat, self.layout), pre, 1

    def accumulate(self, acc: Accumulated | None, grads: Any) -> Accumulated:
        """Add one micro-batch's grads to ``acc`` (``None`` starts a new sum); pass the result
        to ``step`` in place of grads for one update over all micro-batches.

        Stage 1 keeps an FP32 buffer of the full padded size (4P bytes per rank) and
        reduce-scatters once, in ``step``. Stage 2 reduce-scatters every micro-batch and sums
        only this rank's shard in FP32 (4P/N bytes). Keep the loss scale fixed while
        accumulating (it only changes in ``step``): an inf/NaN in any micro-batch makes the sum
        non-finite, so the whole update is skipped.
        """
        layout, _ = self._ready()
        if acc is not None and not isinstance(acc, Accumulated):
            raise TypeError(f"acc must be None or the Accumulated from accumulate, got {type(acc).__name__}")
        for a in (acc, grads):
            if isinstance(a, Accumulated):
                self._check_accumulated(a)
        if isinstance(grads, Accumulated):  # reduced already (grad_and_value): add shards
            if acc is not None and acc.grads.shape != grads.grads.shape:
                raise ValueError(f"cannot add grads of shape {tuple(grads.grads.shape)} to a sum of shape "
                                 f"{tuple(acc.grads.shape)}: accumulate either reduced shards or unreduced grads")
            part = grads.grads.float()
            return Accumulated(part, grads.count) if acc is None else Accumulated(acc.grads + part, acc.count + grads.count)
        if self.stage == 2:
            flat, _ = self._flat_to_reduce(grads)
            part = self.comm.reduce_scatter_sum(flat, self.layout).float()
        else:
            buckets = self._grad_buckets(grads, torch.float32)
            part = buckets[0] if len(buckets) == 1 else torch.cat(buckets)
        if acc is None:
            return Accumulated(part, torch.ones((), dtype=torch.int32, device=self.device))
        return Accumulated(acc.grads + part, acc.count + 1)

    def grad_and_value(self, fn, *, has_aux: bool = False, overlap: bool = True):
        """``torch.func.grad_and_value(fn)`` for the params (first argument), with each
        bucket's reduce-scatter started *inside* backward, as soon as that bucket's grads
        exist (see ``fzero.backward``): communication overlaps the rest of backward.

        Returns ``g(params, *args, **kwargs) -> (grads, value)``: ``params`` as from ``init``/
        ``step`` (pytree or flat buffer), ``fn(params, ...)`` returns the (scaled) 0-d loss, or
        ``(loss, aux)`` with ``has_aux``; ``grads`` is an ``Accumulated`` of this rank's ``[S]``
        reduced shard for ``step`` (or ``accumulate``, which then adds shards: 4P/N bytes at
        any stage). ``overlap=False`` waits for each bucket inside backward instead (same
        results bitwise; for measuring). Eager only; under ``torch.compile`` differentiate
        the whole step with ``flat_params``."""

        def grad_fn(params, *args, **kwargs):
            layout, comm = self._ready()
            if self._check(params, "params"):
                params = unflatten(params, layout)
            dtype, pre = self._reduce_dtype(), self._pre()

            def start_bucket(buf: torch.Tensor, i: int) -> torch.Tensor:  # buf: [N*S_b] grads in dtype, ours
                return comm.reduce_scatter_bucket(buf if pre == 1.0 else buf.div_(pre), i, layout, wait=not overlap)

            shard, value = backward.grad_and_value(fn, params, layout, start_bucket, comm.wait, args, kwargs,
                                                   dtype=dtype, has_aux=has_aux)
            return Accumulated(shard, torch.ones((), dtype=torch.int32, device=self.device)), value

        return grad_fn

    def _ready(self) -> tuple[Layout, Comm]:
        if self.layout is None:
            raise RuntimeError("engine.step called before engine.init")
        self.comm.check_unchanged()
        return self.layout, self.comm

    # ------------------------------------------------------------------ helpers
    def time_collectives(self) -> dict[str, list[float]]:
        """Per-bucket milliseconds of the step's reduce-scatter (in the reduce dtype) and
        all-gather (param dtype), each measured alone, max over ranks; empty lists at world
        size 1. A collective call (every rank must make it) that syncs the host: for a metrics
        log every few steps, not for the hot loop."""
        layout, comm = self._ready()
        return comm.time_buckets(layout, self._reduce_dtype(), self.param_dtype, self.device)

    def state_bytes(self, state: ZeroState) -> int:
        """Bytes of tensor storage this rank holds for optimizer state (master + transform)."""
        return sum(t.numel() * t.element_size() for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor))


def cast_params(master: torch.Tensor, dtype: torch.dtype, *, copy: bool = False) -> torch.Tensor:
    """FP32 master values in the param ``dtype``, *saturating*: values beyond the dtype's
    finite range (65504 for FP16) become its largest finite value instead of inf, so a finite
    master never gives a non-finite param. The master keeps the exact value; NaN stays NaN.
    ``copy``: a new tensor even when ``dtype`` is FP32."""
    if dtype == master.dtype:
        return master.clone() if copy else master
    big = torch.finfo(dtype).max
    return master.to(dtype).nan_to_num_(nan=math.nan, posinf=big, neginf=-big)


def _write_into(old: Any, new: Any) -> Any:
    """Copy every tensor of ``new`` into the matching tensor of ``old``; return ``old``.

    Under ``torch.compile`` inductor stores the step's results straight into the input
    buffers, so the FP32 state is never held twice."""
    for o, n in zip(optree.tree_leaves(old), optree.tree_leaves(new)):
        o.copy_(n)
    return old


def zero1(
    tx,
    *,
    param_dtype: torch.dtype = torch.float16,
    loss_scale=_AUTO,
    group=None,
    reduce_dtype: torch.dtype = torch.float32,
    alignment: int = 64,
    bucket_bytes: int | None = None,
    stage: int = 1,
    offload: str | None = None,
    donate: bool = False,
    chunk_numel: int | None = 2**18,
    simulate: tuple[int, int] | None = None,
) -> Engine:
    """A ZeRO engine (stage 1 by default) for gradient transformation ``tx``.

    Args:
      param_dtype: dtype of the model params the user sees: fp16, bf16 or fp32.
      loss_scale: ``DynamicLossScale()``, ``StaticLossScale(s)`` or ``None`` (no scaling);
        default: dynamic for fp16, none otherwise.
      group: a ProcessGroup; ``None`` = WORLD if torch.distributed is initialized, else one process.
      reduce_dtype: dtype of the gradient reduce-scatter: FP32 (default; 2x the wire bytes of
        FP16, cannot overflow from the sum) or ``param_dtype`` with the FSDP pre/post split of 1/N.
      alignment: each rank's slice of each bucket is a multiple of this many elements.
      bucket_bytes: split the flat buffer into buckets of about this many param bytes, each
        sharded across all ranks (one reduce-scatter and all-gather per bucket), filled in
        reverse leaf order; ``None`` (default): one bucket.
      stage: 1, or 2 for gradient accumulation that reduce-scatters every micro-batch and keeps
        only this rank's FP32 shard of the sum (see ``Engine.accumulate``).
      offload: ``"cpu"`` keeps master weights and transform state in (pinned) host memory and
        runs the update there; params and grads stay on their device. Each step then waits
        for its grads on the host (a device->host copy), by construction.
      donate: ``step`` writes the new optimizer state and params into the input ``state``'s and
        ``params``' buffers and returns them (JAX's ``donate_argnums``): the inputs must not be
        used again. With ``torch.compile`` the FP32 state then exists once during the step and
        nothing state- or param-sized is allocated; without, the step is pure and holds old
        and new state at its peak.
      chunk_numel: an eager step on a CPU shard (CPU training, or ``offload``) updates it in
        chunks of this many elements, so its temporaries stay cache-sized (``None``: all at
        once). Results do not depend on it; compiled steps and CUDA shards ignore it.
      simulate: ``(rank, world_size)``: act as that rank of that many ranks with no process
        group, every rank holding the same grads (for memory accounting on one device).
    """
    return Engine(
        tx,
        param_dtype=param_dtype,
        loss_scale=loss_scale,
        group=group,
        reduce_dtype=reduce_dtype,
        alignment=alignment,
        bucket_bytes=bucket_bytes,
        stage=stage,
        offload=offload,
        donate=donate,
        chunk_numel=chunk_numel,
        simulate=simulate,
    )
