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
computes with them (``_Binding``).

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

import contextlib
from typing import Any

import optree
import torch
from torch import nn
from torch.utils import _pytree as torch_pytree

from .checkpoint.export import full_master
from .checks import shared_memory
from .engine import Engine

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
        self._guard = _Guard.install(net)  # first: it puts back what an earlier functional(net) bound
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
        self._guard.binding = _Binding(net, self._canonical)

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
        # Bound until the next apply or the way back (``_Binding``): activation checkpointing
        # recomputes the forward inside backward, after this call, and must see these tensors.
        self._guard.binding.bind(tensors)
        self._guard.held = True  # from now on the net's own weights are stale
        with self._guard.open():
            out = self.net(*inputs, **kwargs)
        new_buffers = {k: v.detach() for k, v in self._guard.binding.current(self.buffers).items()}
        if not any(p.requires_grad for p in params.values()):
            out = _refuse_backward(self.net, out)
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


class _Binding:
    """Which tensors ``net``'s modules hold: its own (``Parameter`` objects and buffers) or those
    of the last ``apply``. ``torch.func.functional_call`` puts the given tensors in for the call
    and its own back when the forward returns; activation checkpointing
    (``torch.utils.checkpoint``, HF's ``gradient_checkpointing_enable``) runs the forward of a
    block again inside *backward*, after ``apply`` returned, and would then compute with the
    net's own weights: wrong grads, or a dtype mismatch with the saved activations. So ``apply``
    leaves its tensors in the modules' slots until the next ``apply`` or the way back
    (``state_dict``/``load_into``, which put the net's own back); meanwhile ``_Guard`` refuses
    the net's own forward, ``state_dict`` and ``load_state_dict``."""

    def __init__(self, net: nn.Module, canonical: dict[str, str]):
        self.slots = {}  # every name, tied aliases included -> (the dict that holds it, key)
        for alias, name in canonical.items():
            prefix, _, leaf = alias.rpartition(".")
            mod = net.get_submodule(prefix)
            self.slots[alias] = (mod._parameters if leaf in mod._parameters else mod._buffers, leaf, name)
        self.own = {alias: slot[key] for alias, (slot, key, _) in self.slots.items()}
        self.bound = False

    def bind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Every slot holds ``tensors[its canonical name]``."""
        for slot, key, name in self.slots.values():
            slot[key] = tensors[name]
        self.bound = True

    def current(self, names) -> dict[str, torch.Tensor]:
        """What the slots of ``names`` hold now (a forward may have replaced a buffer)."""
        held = {name: slot[key] for slot, key, name in self.slots.values()}
        return {name: held[name] for name in names}

    def release(self) -> None:
        """The net's own tensors back in every slot."""
        if self.bound:
            for alias, (slot, key, _) in self.slots.items():
                slot[key] = self.own[alias]
            self.bound = False


class _Guard:
    """Hooks on the net that refuse its own forward, ``state_dict`` and ``load_state_dict`` while
    fzero trains it (``held``: from the first ``apply`` until ``load_into``): they would act on
    the weights it had before training, or on tensors ``apply`` left bound (``_Binding``), and
    the trained weights are the engine's (the FP32 master and the params it returns). ``open``
    lets fzero's own calls through. One guard per net: a later ``functional(net)`` takes it."""

    def __init__(self, net: nn.Module):
        self.name, self.held, self.inside, self.binding = type(net).__name__, False, 0, None
        # an older torch has the load pre-hook under its private name only (the same hook signature)
        load_hook = getattr(net, "register_load_state_dict_pre_hook", None) or (
            lambda hook: net._register_load_state_dict_pre_hook(hook, with_module=True))
        self.handles = [net.register_forward_pre_hook(self._forward),
                        net.register_state_dict_pre_hook(self._state_dict), load_hook(self._load_state_dict)]

    @classmethod
    def install(cls, net: nn.Module) -> "_Guard":
        """A new guard on ``net``; an earlier one's hooks removed and its binding released."""
        old = net.__dict__.get("_fzero_guard")
        if old is not None:
            if old.binding is not None:  # None: that functional(net) raised before binding
                old.binding.release()
            for h in old.handles:
                h.remove()
        guard = net.__dict__["_fzero_guard"] = cls(net)
        return guard

    @contextlib.contextmanager
    def open(self):
        """fzero's own calls of the net's forward, ``state_dict`` and ``load_state_dict`` pass."""
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    def _refuse(self, what: str, instead: str) -> None:
        if self.held and not self.inside:
            raise RuntimeError(f"fzero.module: {self.name}.{what} while fzero trains the net (fzero.module.functional): "
                               f"the net's own weights are those from before training; the trained ones are the "
                               f"engine's. {instead}")

    def _forward(self, module, args):
        self._refuse("forward", "Run it as `out, buffers = fm.apply(params, buffers, x)` (under torch.no_grad() "
                     "to evaluate), or copy the trained weights in first with `fm.load_into(params, buffers, "
                     "engine=engine, state=state)` (every rank), after which `net(x)` runs them")

    def _state_dict(self, module, prefix, keep_vars):
        self._refuse("state_dict()", "Call `fm.state_dict(params, buffers, engine=engine, state=state)` on every "
                     "rank (collective: the FP32 master) and torch.save it on rank 0, or `fm.load_into(...)` first")

    def _load_state_dict(self, module, state_dict, prefix, *args):
        self._refuse("load_state_dict()", "Set the trained weights with `params, state = engine.load_params(state, "
                     "{k: sd[k] for k in fm.params})` on every rank, or load into the net before engine.init")


class _GradAndValueOnly(torch.autograd.Function):
    """Identity on ``x``, tied to a leaf that needs grad, whose backward raises ``message``."""

    @staticmethod
    def forward(ctx, anchor, x, message):
        ctx.message = message
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(ctx.message)


def _refuse_backward(net: nn.Module, out):
    """``out`` (any pytree torch knows, HF's ``ModelOutput`` included) whose floating tensors'
    backward raises naming ``engine.grad_and_value``, where the net is in training mode with grad
    mode on and no param needs grad: ``loss.backward()`` on such an output is the torch habit,
    and would fail with torch's "element 0 of tensors does not require grad". In evaluation
    (``net.eval()`` or ``torch.no_grad()``) ``out`` is returned as it is."""
    if not (net.training and torch.is_grad_enabled()):
        return out
    message = (f"fzero.module: backward through fm.apply's output of {type(net).__name__}: the params fzero "
               "returns do not need grad; take the grads with `grads, loss = engine.grad_and_value(loss_fn)(params, "
               "scaler_state, *batch)`, where loss_fn(params, *batch) calls fm.apply and returns the loss, then "
               "`engine.step(params, grads, state, scaler_state)`")
    anchor = torch.zeros((), requires_grad=True)
    tie = lambda x: (_GradAndValueOnly.apply(anchor, x, message)
                     if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
    return torch_pytree.tree_map(tie, out)


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
