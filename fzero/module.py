"""An ``nn.Module`` as fzero trains it: params, buffers, a pure ``apply``, and the way back.

::

    fm = fzero.module.functional(net)                    # net: any nn.Module, FP32
    params, state, scaler_state = engine.init(fm.params)
    buffers = fm.buffers
    ...                                                  # each step:
    buffers = fzero.module.broadcast_buffers(engine, buffers)   # rank 0's, as DDP does
    out, buffers = fm.apply(params, buffers, x)          # inside the loss, under engine.grad_and_value
    ...                                                  # at the end:
    fm.load_into(params, buffers, engine=engine, state=state)   # FP32 master and buffers into net

**Params.** ``fm.params`` is ``{qualified name: tensor}``, the net's own parameters detached (no
copy: the same memory). A parameter tied to several names (one ``Parameter`` object: an
embedding reused as the output layer) appears once, under its first name; ``apply`` puts it in
every place (as ``functional_call``'s ``tie_weights``), so its grad is the sum over its uses, as in
the net, and fzero -- which refuses two leaves over one memory, each leaf having its own master --
sees one leaf. Two *different* ``Parameter`` objects over one memory (views of one tensor)
would train apart: ``functional`` refuses them, naming both.

**Frozen params** (``requires_grad=False`` when ``functional`` is called) are not in ``params``
but in ``frozen`` (detached, no copy): ``apply`` passes them to the forward as constants in the
compute dtype, fzero neither trains them nor holds state for them, as ``torch.optim`` over the
params that need grad.

**While fzero trains the net** (from the first ``apply`` until ``load_into``) the net's own
weights are stale: its own ``forward``, ``state_dict`` and ``load_state_dict`` raise, naming the
call to make instead; ``apply`` leaves its tensors in the modules until the next ``apply`` or the
way back, so that activation checkpointing, which runs a block's forward again inside backward,
computes with them (``fzero.net_guard.NetBinding``).

**apply(params, buffers, \\*inputs, \\*\\*kwargs) -> (output, new_buffers)** is pure: it runs
``net``'s forward (with the given tensors in its modules, as ``torch.func.functional_call``; in the net's mode: ``net.train()`` /
``net.eval()``) on copies of the buffers, so the in-place updates a forward makes (BatchNorm's
running statistics and batch counter in training mode) come back as ``new_buffers`` and the
buffers given stay as they were. The params must share one floating dtype, the *compute dtype*:

* floating input tensors (at any depth of ``inputs`` and ``kwargs``) are cast to it (FSDP2's
  ``cast_forward_inputs``; ``cast_inputs=False`` leaves them as given);
* the modules of the classes in ``fp32_modules`` (default ``FP32_MODULES``: BatchNorm,
  SyncBatchNorm, InstanceNorm) keep their floating buffers in FP32 and get their own params
  upcast to FP32 (exact; the grads flow back through the cast): what ``torch.autocast`` does, under
  which BatchNorm sees activations in BF16/FP16 but its weight and running statistics in FP32.
  A running statistic is an average over many steps (momentum 0.1): in BF16 (8 significant
  bits) its updates would round away; torch's kernels take this mix (input in a low precision,
  the rest FP32) and not BF16 params with FP32 statistics;
* every other floating buffer is cast to the compute dtype (FSDP1's ``buffer_dtype``): it enters
  the module's arithmetic next to the activations, where an FP32 tensor would turn the
  computation FP32 or fail on a dtype mismatch. Integer buffers stay as they are.

**Across ranks.** A forward updates the buffers from this rank's rows only; ``broadcast_buffers``
gives every rank rank 0's, as DDP's ``broadcast_buffers=True`` does before each forward.

**Back into the net.** ``state_dict`` returns ``net.state_dict()``'s keys (a tied parameter under
each of its names) with the trained values in the net's own dtypes and devices: with
``engine=`` and ``state=``, the FP32 master (``fzero.checkpoint.full_master``: collective);
without, the params as given. ``load_into`` copies them, and every buffer, into ``net`` in place.
"""
from __future__ import annotations

from typing import Any

import optree
import torch
from torch import nn

from .checkpoint.export import full_master
from .engine import Engine
from .memory import shared_memory
from .net_guard import NetBinding, Guard, refuse_backward

__all__ = ["FP32_MODULES", "FunctionalModule", "functional", "broadcast_buffers"]

FP32_MODULES: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)


def functional(net: nn.Module, *, cast_inputs: bool = True,
               fp32_modules: tuple[type[nn.Module], ...] = FP32_MODULES) -> "FunctionalModule":
    """``net`` as fzero trains it (see the module docstring). ``ValueError`` for a net with no
    parameters, or with two parameters over one memory."""
    return FunctionalModule(net, cast_inputs=cast_inputs, fp32_modules=fp32_modules)


class FunctionalModule:
    """``params``, ``buffers`` (the net's, detached), ``apply``, ``state_dict``, ``load_into``."""

    def __init__(self, net: nn.Module, *, cast_inputs: bool, fp32_modules: tuple[type[nn.Module], ...]):
        self.net, self.cast_inputs = net, cast_inputs
        self._guard = Guard.install(net)  # first: it puts back what an earlier functional(net) bound
        named = list(net.named_parameters())
        if not named:
            raise ValueError(f"{type(net).__name__} has no parameters: nothing for fzero to train")
        shared = shared_memory([p for _, p in named])
        if shared is not None:
            a, b = (named[i][0] for i in shared)
            raise ValueError(f"parameters {a!r} and {b!r} are two Parameters over one memory: they would train apart. "
                             f"Tie them as one Parameter ({b} = {a}), which fzero trains once and uses in both places")
        if not any(p.requires_grad for _, p in named):
            raise ValueError(f"every parameter of {type(net).__name__} has requires_grad=False: nothing for fzero to "
                             "train (set requires_grad=True on the ones to train before fzero.module.functional)")
        self.params = {name: p.detach() for name, p in named if p.requires_grad}
        self.frozen = {name: p.detach() for name, p in named if not p.requires_grad}
        self.buffers = {name: b.detach() for name, b in net.named_buffers()}
        self._fp32_params, self._fp32_buffers = set(), set()
        for prefix, mod in net.named_modules():
            if isinstance(mod, fp32_modules):
                dot = f"{prefix}." if prefix else ""
                self._fp32_params |= {dot + n for n, _ in mod.named_parameters(recurse=False)}
                self._fp32_buffers |= {dot + n for n, _ in mod.named_buffers(recurse=False)} & self.buffers.keys()
        # every name in state_dict() -> the name in params/frozen/buffers of the same tensor (tied aliases)
        first = {id(t): name for name, t in [*net.named_parameters(), *net.named_buffers()]}
        aliases = [*net.named_parameters(remove_duplicate=False), *net.named_buffers(remove_duplicate=False)]
        self._canonical = {name: first[id(t)] for name, t in aliases}
        self._guard.binding = NetBinding(net, self._canonical)

    # ------------------------------------------------------------------ forward
    # ------------------------------------------------------------------ forward
    def compute_dtype(self, params: dict[str, torch.Tensor]) -> torch.dtype:
        """The one floating dtype of ``params`` (``TypeError`` naming two leaves if they differ)."""
        dtypes = {}
        for name, p in params.items():
            dtypes.setdefault(p.dtype, name)
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise TypeError("apply: the params must share one floating dtype, got "
                            + ", ".join(f"{d} ({name!r}...)" for d, name in dtypes.items()))
        return next(iter(dtypes))

    def apply(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *inputs, **kwargs):
        """``(output, new_buffers)``: ``net(*inputs, **kwargs)`` with ``params`` and copies of
        ``buffers`` (see the module docstring for the dtypes); ``params``, ``buffers`` and the
        inputs are not modified."""
        _check_names("params", params, self.params)
        _check_names("buffers", buffers, self.buffers)
        dtype = self.compute_dtype(params)
        fp32 = lambda k: torch.float32 if k in self._fp32_params else dtype
        tensors = {k: v.to(fp32(k)) for k, v in params.items()}
        tensors.update({k: v.to(fp32(k)) for k, v in self.frozen.items()})  # constants: no grad, no state
        tensors.update({k: v.to(torch.float32 if k in self._fp32_buffers else dtype, copy=True) if v.is_floating_point()
                        else v.clone() for k, v in buffers.items()})
        if self.cast_inputs:
            inputs, kwargs = optree.tree_map(
                lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, (inputs, kwargs))
        # Bound until the next apply or the way back (``fzero.net_guard.NetBinding``): activation checkpointing
        # recomputes the forward inside backward, after this call, and must see these tensors.
        self._guard.binding.bind(tensors)
        self._guard.held = True  # from now on the net's own weights are stale
        with self._guard.open():
            out = self.net(*inputs, **kwargs)
        new_buffers = {k: v.detach() for k, v in self._guard.binding.current(self.buffers).items()}
        if not any(p.requires_grad for p in params.values()):
            out = refuse_backward(self.net, out)
        return out, new_buffers

    # ------------------------------------------------------------------ back into the net
    def state_dict(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *,
                   engine: Engine | None = None, state=None) -> dict[str, torch.Tensor]:
        """``net.state_dict()``'s keys with the trained values (new tensors in the net's dtypes
        and devices): the FP32 master given ``engine`` and ``state`` (collective: every rank),
        else ``params`` as given; ``buffers`` as given (``broadcast_buffers`` first on several
        ranks, for rank 0's). ``torch.save`` it, or ``load_into``."""
        if (engine is None) != (state is None):
            raise ValueError("state_dict: give engine= and state= together (the FP32 master), or neither (the params)")
        values = params if engine is None else full_master(params, state, engine, where="fzero.module state_dict/load_into")
        _check_names("params", values, self.params)
        _check_names("buffers", buffers, self.buffers)
        values = {**values, **self.frozen, **buffers}
        self._guard.binding.release()  # the net's own tensors: their dtypes and devices
        out = {}
        with self._guard.open():
            mine_all = self.net.state_dict(keep_vars=True)
        for key, mine in mine_all.items():
            if key not in self._canonical:  # a module's extra state: the net's own
                out[key] = mine
                continue
            value = values[self._canonical[key]]
            if value.shape != mine.shape:
                raise ValueError(f"state_dict: {key!r} has shape {tuple(value.shape)}, the net's {tuple(mine.shape)}")
            out[key] = value.detach().to(device=mine.device, dtype=mine.dtype, copy=True)
        return out

    def load_into(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *,
                  engine: Engine | None = None, state=None) -> nn.Module:
        """Copy ``state_dict(...)`` into ``net`` in place (``load_state_dict``, strict), and the
        buffers that are not in a state dict (``persistent=False``) too; returns ``net``. Its
        ``Parameter`` objects stay the same, and ``params`` (their detached views) then hold the
        trained values."""
        values = self.state_dict(params, buffers, engine=engine, state=state)
        with self._guard.open():
            self.net.load_state_dict(values)
        with torch.no_grad():
            for name, b in self.net.named_buffers():
                if name not in values:
                    b.copy_(buffers[name])
        self._guard.held = False  # the net holds the trained weights: its own calls are right again
        return self.net


def broadcast_buffers(engine_or_comm, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank 0's ``buffers`` on every rank (rank 0 of the whole data-parallel world: replica 0,
    shard 0 on a hybrid mesh), as new tensors; ``buffers`` is not modified. DDP's
    ``broadcast_buffers=True``: call before each forward, and once after the last one for a net
    that is the same on every rank. One ``broadcast`` per dtype (the buffers packed into one
    tensor), none at one rank. ``engine_or_comm``: the engine (before or after ``init``) or its
    communicator (``fzero.comm``); every rank of it must call, with buffers of the same names,
    shapes and dtypes."""
    comm = engine_or_comm.comm if isinstance(engine_or_comm, Engine) else engine_or_comm
    if comm.data_parallel == 1:
        return dict(buffers)
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for name, b in buffers.items():
        groups.setdefault((b.dtype, b.device), []).append(name)
    out = {}
    with torch.no_grad():
        for (dtype, _), names in groups.items():
            flat = comm.broadcast(torch.cat([buffers[n].reshape(-1) for n in names]), f"the {dtype} buffers")
            pos = 0
            for n in names:
                out[n] = flat[pos : pos + buffers[n].numel()].view_as(buffers[n])
                pos += buffers[n].numel()
    return {n: out[n] for n in buffers}


def _check_names(what: str, given: Any, want: dict[str, Any]) -> None:
    """``given`` is a dict with the names of ``want`` (the net's params or buffers)."""
    if not isinstance(given, dict):
        raise TypeError(f"{what} must be a dict {{name: tensor}} like the net's, got {type(given).__name__}")
    if given.keys() != want.keys():
        missing, unknown = sorted(want.keys() - given.keys()), sorted(given.keys() - want.keys())
        raise ValueError(f"{what} do not match the net's: missing {missing}, unknown {unknown}")
