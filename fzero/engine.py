"""The ZeRO mixed-precision engine: configuration, ``init`` and ``step``.

Per rank, with P parameter elements, N ranks and S = padded P / N:

* ``params``: the user's pytree, leaves are ``param_dtype`` views of one flat ``[N*S]`` buffer
  (2P bytes for FP16/BF16), identical on every rank;
* ``state.master``: this rank's ``[S]`` FP32 master shard, plus the transform's state on it
  (AdamW: two more FP32 ``[S]`` moments) -- 12S bytes, never 12P (on the host with
  ``offload="cpu"``); as ``fzero.storage`` keeps it: 10S with ``master="remainder"`` (BF16
  params), 8S with ``master="params"`` (FP32 params: their own shard is the master);
* ``scaler_state``: the 0-d loss-scale tensors.

The step is pure unless ``donate=True``: it returns new params/state and leaves its inputs
untouched. Its path is ``fzero.plan``'s, its stages ``fzero.stages``' (docs/design.md maps the rest).
"""
from __future__ import annotations

import math
from typing import Any

import optree
import torch

from . import checks, lineage, plan, stages
from .binding import (Binding, ZeroState, communicator, config_table, first_rank_shard, fresh_state, gathered,
                      shapes_context, state_bytes, to_state_device)
from .cast import cast_params, write_into
from .flat import flat_buffer
from .grad_forms import Accumulated
from .grads import GradFn, GradPath
from .layout import Layout, make_layout
from .params_form import ParamsForm
from .plan import Kernels
from .scaler import DynamicLossScale, LossScaleState, NoLossScale
from .shard_view import ShardView, bind
from .storage import master_storage

__all__ = ["ZeroState", "Accumulated", "Engine", "cast_params"]


class Engine:
    """Built by ``fzero.zero1`` (``fzero.options``); the arguments are documented there.

    ``init`` binds the engine to one layout (the params' structure and shapes, the world size,
    the device), once; ``step`` is then a function of its arguments and that static metadata,
    and nothing in the engine changes any more. A later ``init`` with params of the same layout
    returns a fresh state for the same binding; params of another layout raise (build another
    engine). The binding stays here rather than in the state so that the state is a pytree of
    tensors only: what a checkpoint stores, and what ``torch.compile`` guards on."""

    def __init__(self, tx, *, param_dtype, loss_scale, group, mesh, reduce_dtype, wire_dtype, alignment, bucket_bytes,
                 stage, offload, donate, chunk_numel, simulate, master, call_timeout, overlap_gather):
        self.tx = tx
        self.param_dtype = checks.check_param_dtype(param_dtype)
        self.storage = master_storage(master, self.param_dtype)  # how state.master holds the FP32 master
        self.master = self.storage.name  # zero1(master=...), as given
        if loss_scale == "auto":
            loss_scale = DynamicLossScale() if param_dtype == torch.float16 else None
        self.loss_scale = loss_scale if loss_scale is not None else NoLossScale()
        checks.check_options(self.loss_scale, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                             wire_dtype=wire_dtype, stage=stage, overlap_gather=overlap_gather,
                             offload=offload, bucket_bytes=bucket_bytes, chunk_numel=chunk_numel,
                             call_timeout=call_timeout)
        # Every rank's slice a whole number of the transform's blocks (8-bit moments: one scale
        # per block), so that no block straddles two ranks: the transform stays rank-blind.
        self.reduce_dtype, self.alignment, self.stage = reduce_dtype, math.lcm(alignment, tx.block), stage
        self.wire_dtype = param_dtype if wire_dtype is None else wire_dtype
        self.overlap_gather = overlap_gather
        self.bucket_numel = None if bucket_bytes is None else max(1, bucket_bytes // param_dtype.itemsize)
        self.offload, self.donate, self.chunk_numel, self.call_timeout = offload, donate, chunk_numel, float(call_timeout)
        self.comm = communicator(group=group, mesh=mesh, simulate=simulate)
        self._bound: Binding | None = None
        self._shard_tx = tx
        self._context: ShardView | None = None
        self._kernels: Kernels | None = None  # what the steps may run (``fzero.plan``; fixed at the first init)

    @property
    def layout(self) -> Layout | None:
        """The flat layout ``init`` fixed (``None`` before)."""
        return None if self._bound is None else self._bound.grads.layout

    @property
    def device(self) -> torch.device | None:
        """Where params and grads live (``None`` before ``init``)."""
        return None if self._bound is None else self._bound.grads.device

    @property
    def shard_context(self) -> ShardView:
        """The ``ShardContext`` ``init`` gave the transform (``fzero.shard_view.ShardView``): which
        leaf each element of this rank's shard belongs to; checkpoints map a ``partition``'s
        grouped state to global coordinates through it. Raises before ``init``."""
        self._ready()
        return self._context

    @property
    def grad_path(self) -> GradPath:
        """The ``fzero.grads.GradPath`` ``init`` fixed: layout, communicator, device and dtypes of
        the grads, and the ways to reduce and accumulate them. Raises before ``init``."""
        return self._ready().grads

    # ------------------------------------------------------------------ init
    def init(self, params: Any) -> tuple[Any, ZeroState, LossScaleState]:
        """``params``: pytree of floating tensors (FP32 recommended), never modified.

        Returns ``(params, state, scaler_state)``: ``params`` are ``param_dtype`` views of one
        new flat buffer; ``state`` holds this rank's FP32 shard and the transform state. Every
        rank trains rank 0's ``params``, as DDP broadcasts rank 0's weights when it is built
        (``Communicator.first_rank_shard``): ranks seeded apart, or pretrained weights loaded on
        rank 0 only, start from rank 0's, never from a mix of every rank's own shard.
        """
        checks.check_params(params)
        comm = self.comm
        comm.arrive("engine.init", timeout=self.call_timeout)
        layout = make_layout(params, comm.world_size, alignment=self.alignment, bucket_numel=self.bucket_numel)
        device = optree.tree_leaves(params)[0].device
        state_device = torch.device("cpu") if self.offload else device
        shard, first_params = first_rank_shard(comm, params, layout, "params", self.param_dtype, state_device)
        context = shapes_context(params, layout, comm, device)
        state = self.stored(fresh_state(self.tx, context, shard), first_params)
        # Before the first collective on tensors: ranks that differ in layout, dtypes, loss
        # scaling or transform would otherwise mix their tensors (or abort inside gloo/NCCL).
        settings = {"param_dtype": str(self.param_dtype), "master": self.storage.name, "reduce_dtype": str(self.reduce_dtype),
                    "wire_dtype": str(self.wire_dtype), "loss_scale": repr(self.loss_scale), "stage": str(self.stage),
                    "offload": repr(self.offload), "overlap_gather": repr(self.overlap_gather)}
        comm.check_same("engine configuration", {**layout.table(), **config_table(settings, layout, state.tx_state)})
        summed = comm.data_parallel > 1  # else nothing is summed or sent: the grads stay in the param dtype
        reduce_dtype, wire_dtype = (self.reduce_dtype, self.wire_dtype) if summed else (self.param_dtype, self.param_dtype)
        bound = Binding.of(GradPath(layout, comm, device, self.param_dtype, reduce_dtype, wire_dtype, self.stage),
                           state_device, state.tx_state)
        if self._bound is None:
            self._bound = bound
            self._context = context.prepare() if self.tx.needs_context else context
            self._shard_tx = bind(self.tx, context)  # the transform as the step runs it on the shard
            self._kernels = plan.kernels(self.tx, self._shard_tx, state.tx_state, self.storage, bound,
                                         world_size=comm.world_size, donate=self.donate, chunk_numel=self.chunk_numel,
                                         overlap_gather=self.overlap_gather)
        elif self._bound != bound:
            raise ValueError("engine.init: this engine is bound to other params (structure, shapes, device or "
                             "transform state) by an earlier init; build a new engine with fzero.zero1 for them")
        new_params = gathered(comm, first_params, layout)
        lineage.mark(new_params, state.master)
        return new_params, state, self.loss_scale.init(device)

    def load_params(self, state: ZeroState, values: Any) -> tuple[Any, ZeroState]:
        """Set the weights after ``init`` (pretrained weights, a surgery): the supported way,
        where writing into the param views is not (the master is the truth; see ``fzero.lineage``).

        ``values``: a pytree like the params, any floating dtype (FP32 keeps full precision).
        Returns ``(params, state)``: the master shard is rank 0's ``values``' shard in FP32,
        exactly as ``init`` builds it, the params its cast, all-gathered; the transform state
        (moments, counts, hyperparameters) is kept. Call on every rank; the step's inputs are not
        modified. With ``donate=True`` the new state goes on with the given one's transform
        state, which the next step writes: the given state is consumed (``fzero.lineage``), as a
        step's is; a consumed one raises."""
        b = self._ready()
        lineage.refuse_consumed(state, "engine.load_params")
        layout, comm = b.grads.layout, self.comm
        checks.check_params(values)
        checks.check_like_layout(values, layout, what="values", device=b.grads.device)
        comm.arrive("engine.load_params", timeout=self.call_timeout)
        shard, params_shard = first_rank_shard(comm, values, layout, "values", self.param_dtype, b.state_device)
        new_state = self.stored(ZeroState(shard, state.tx_state), params_shard)
        new_params = gathered(comm, params_shard, layout)
        if self.donate:
            lineage.consume(state)
        lineage.mark(new_params, new_state.master)
        return new_params, new_state

    def state_like(self) -> tuple[ZeroState, LossScaleState]:
        """A fresh ``(state, scaler_state)`` with the structure, dtypes and devices ``init`` built, an
        FP32 master in any ``master`` mode (what a checkpoint holds): what ``fzero.checkpoint.load`` fills."""
        b = self._ready()
        layout, device = b.grads.layout, b.grads.device
        master = to_state_device(torch.zeros(layout.shard_numel, device=device), b.state_device)
        return fresh_state(self.tx, self._context, master), self.loss_scale.init(device)

    # ------------------------------------------------------------------ the master's storage
    def with_fp32_master(self, params: Any, state: ZeroState, *, where: str = "engine.with_fp32_master") -> ZeroState:
        """``state`` with its FP32 master shard: with ``master="remainder"`` rebuilt, exactly,
        from this rank's shard of ``params`` (pytree or flat buffer) and the remainder; with
        ``"params"`` that shard itself; the state itself otherwise. Raises (naming ``where``)
        if ``params`` were edited in place since the engine returned them, or, with a master
        read from the params, come from another step (``fzero.lineage``)."""
        b, form = self._door(params, traced=plan.tracing())
        lineage.check(form, state.master, where=where, same_step=self.storage.reads_params)
        return self._full(form, state)

    def stored(self, state: ZeroState, params_shard: torch.Tensor) -> ZeroState:
        """What the state keeps of ``state``, whose master is FP32 and whose params shard (that master
        cast to ``param_dtype``) is ``params_shard``: ``fzero.storage``'s ``store`` (``master="remainder"``:
        the int16 remainder; ``"params"``: an empty tensor; ``"fp32"``: the state itself)."""
        return state._replace(master=self.storage.store(state.master, params_shard))

    def _full(self, params: ParamsForm, state: ZeroState) -> ZeroState:
        """``state`` with the FP32 master its storage rebuilds (from this rank's shard of
        ``params``, the door's form, which only a storage that reads the params asks for)."""
        shard = lambda: params.shard(self.layout, self.comm.rank)  # noqa: E731
        return state._replace(master=self.storage.full(state.master, shard))

    # ------------------------------------------------------------------ step
    def step(self, params: Any, grads: Any, state: ZeroState, scaler_state: LossScaleState):
        """One optimizer step. ``params``: the pytree from ``init``/``step``, or its flat buffer
        (``flat_params``; the new params then come back flat too). ``grads`` are d(scaled
        loss)/d(params), this rank's: a pytree like params, the ``[N*S]`` grad of the flat
        buffer, or an ``Accumulated`` sum of micro-batches (applied as the sum, as DDP's
        ``no_sync`` applies it).

        reduce-scatter -> unscale and average over ranks -> one all-reduce of the squared norm
        (which carries found_inf) -> transform -> keep old values if not finite -> cast ->
        all-gather -> loss-scale update. Returns ``(params, state, scaler_state, info)``; ``info``
        holds 0-d tensors: ``found_inf`` (bool, agreed by all ranks), ``loss_scale`` (used this
        step), ``grad_norm`` (global L2 norm of the unscaled grads it applies, before clipping) and
        ``scale_stuck`` (bool: overflows persist at the minimum scale, see ``fzero.scaler``;
        ``fzero.nonfinite_leaves(grads)`` then names the culprits, off the hot path), and the
        transform's ``hyperparams`` at this step (``lr``: the learning rate it applied, or would
        have; a non-finite one skips the update, the loss scale unchanged).
        """
        traced = plan.tracing()
        b, form = self._door(params, traced=traced)
        step_plan = plan.choose(self._kernels, form, b.grads.layout, compiled=traced)
        path = b.grads
        master_numel = self.storage.numel(path.layout.shard_numel)
        checks.check_state(state, scaler_state, ZeroState, master_numel, b.tx_leaves, b.tx_spec,
                           master_dtype=self.storage.dtype, compiled=step_plan.compiled)
        lineage.check(step_plan.params, state.master, where="engine.step", same_step=self.storage.reads_params)
        given, state = state, self._full(step_plan.params, state)  # the FP32 master (remainder: joined; params: theirs)

        reduced = stages.reduce(path, grads, step_plan)
        checked = stages.norm_and_overflow(path, reduced, scaler_state.scale, self._shard_tx, state.tx_state, step_plan)
        master, tx_state, shard = stages.update(self._shard_tx, checked, state.master, state.tx_state, step_plan)
        new_params = stages.gather(path, shard, step_plan)
        scale, scaler_state = scaler_state.scale, self.loss_scale.update(scaler_state, checked.found_inf)

        info = {"found_inf": checked.found_inf, "loss_scale": scale, "grad_norm": checked.norm.float(),
                "scale_stuck": self.loss_scale.stuck(scaler_state), **checked.rates}
        new_state = self.stored(ZeroState(master, tx_state), shard)  # what the storage keeps of the FP32 master
        if step_plan.donate:  # write into the inputs' buffers: no allocation of state
            new_state = lineage.hand_over(write_into(given, new_state))
        lineage.mark(new_params, new_state.master)
        return new_params, new_state, scaler_state, info

    # ------------------------------------------------------------------ grads
    def accumulate(self, acc: Accumulated | None, grads: Any) -> Accumulated:
        """Add one micro-batch's grads to ``acc`` (``None`` starts a new sum); pass the result
        to ``step`` in place of grads for one update over all micro-batches (stage 1 sums the
        FP32 ``[N*S]`` grads, stage 2 this rank's reduced ``[S]`` shard: see ``fzero.grads``).
        ``step`` applies the sum, as DDP's ``no_sync`` does: divide each micro-batch's loss by
        their number (``loss / ACCUM``) for the grads of the whole batch's mean loss."""
        return self._ready().grads.accumulate(acc, grads)

    def grad_and_value(self, fn, *, has_aux: bool = False, overlap: bool = True) -> GradFn:
        """The grads of ``fn`` (the plain loss of ``(params, *args, **kwargs)``) for ``step``, the
        loss scale applied, each bucket's reduce-scatter started inside backward: ``g(params,
        scaler_state, *args, **kwargs) -> (grads, unscaled loss)``; micro-batches with
        ``g.no_sync``/``g.sync`` (``fzero.grads.GradFn``), whose grads ``step`` sums as DDP does
        (``fn`` divides each micro-batch's loss by their number for the whole batch's mean)."""
        return GradFn(lambda: self._ready().grads, fn, has_aux=has_aux, overlap=overlap)

    def flat_params(self, params: Any) -> torch.Tensor:
        """The ``[N*S]`` flat buffer that ``params``' leaves are views of.

        Differentiate with respect to it to get the grads already flat -- no per-leaf copy in
        the step -- and pass that tensor to ``step`` as ``grads``; pass the buffer itself as
        ``params`` to get the new flat buffer back (one copy with ``donate``, not one per leaf)::

            flat = engine.flat_params(params)
            grads = torch.func.grad(lambda f: loss_fn(fzero.unflatten(f, engine.layout), batch))(flat)
            flat, state, scaler_state, info = engine.step(flat, grads, state, scaler_state)

        With ``donate=True`` the buffer stays the same across steps. With ``loss.backward()``
        instead of ``torch.func``, ``fzero.unflatten(flat, engine.layout, like=params,
        grads_into=grads)`` has backward write the grads into a buffer kept across steps
        (``examples/recipe.py: make_train_step``)."""
        path = self._ready().grads
        leaves = checks.check_like_layout(params, path.layout, what="params", device=path.device, dtype=self.param_dtype)
        return flat_buffer(leaves, path.layout)

    # ------------------------------------------------------------------ helpers
    def _door(self, params: Any, *, traced: bool) -> tuple[Binding, ParamsForm]:
        """The binding and the form of the ``params`` a call takes (``fzero.params_form``: checked
        at the grads' door, their buffer looked up unless ``traced``)."""
        b = self._ready(traced)  # raises before init
        return b, ParamsForm.of(params, b.grads.check(params, "params"), b.grads.layout, traced=traced)

    def _ready(self, compiled: bool | None = None) -> Binding:
        """The binding ``init`` fixed (raises before), the communicator checked unless ``compiled`` (traced)."""
        if self._bound is None:
            raise RuntimeError("engine.step called before engine.init")
        # Eager only: traced, the check would put the ProcessGroup object into the graph (a script
        # object, which keeps the group's backend threads alive after destroy_process_group). A
        # compiled step's collectives name their group instead.
        if not (plan.tracing() if compiled is None else compiled):
            self.comm.check_unchanged()
        return self._bound

    def params_from(self, params: Any, state: ZeroState, fn) -> Any:
        """Params made from this rank's shard of the state and gathered from every rank, as a new
        pytree in ``param_dtype`` (the cast is the step's, saturating): Schedule-Free's
        evaluation params, ``engine.params_from(params, state,
        transforms.schedule_free_eval_params)``. ``fn(tx_state, master)`` gets this rank's
        transform state and FP32 master shard (``[S]``) and returns an FP32 ``[S]`` tensor laid
        out like the master (an elementwise function of the two: ``fn`` sees a shard, not
        leaves). An all-gather: call it on every rank. ``params``, ``state``: the step's."""
        b = self._ready()
        master = self.with_fp32_master(params, state, where="engine.params_from").master
        shard = fn(state.tx_state, master)
        if not (isinstance(shard, torch.Tensor) and shard.shape == master.shape and shard.is_floating_point()):
            got = type(shard).__name__ if not isinstance(shard, torch.Tensor) else f"{shard.dtype} {tuple(shard.shape)}"
            raise ValueError(f"engine.params_from: fn returned {got}; it must return a floating tensor of this rank's "
                             f"shard's shape {tuple(master.shape)}")
        return gathered(self.comm, cast_params(shard.float().to(b.grads.device), self.param_dtype), b.grads.layout)

    def time_collectives(self) -> dict[str, list[float]]:
        """Per-bucket milliseconds of the step's reduce-scatter (grads in the wire dtype, summed in
        the reduce dtype) and all-gather (param dtype), each measured alone, max over ranks; empty
        lists at world size 1. A collective call (every rank must make it) that syncs the host:
        for a metrics log, not the hot loop."""
        path = self._ready().grads
        self.comm.arrive("engine.time_collectives", timeout=self.call_timeout)
        return self.comm.time_buckets(path.layout, path.wire_dtype, path.reduce_dtype, self.param_dtype, path.device)

    def state_bytes(self, state: ZeroState) -> int:
        """Bytes of tensor storage this rank holds for optimizer state (master + transform)."""
        return state_bytes(state)
