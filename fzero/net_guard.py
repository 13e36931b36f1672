"""The net while fzero trains it (``fzero.module.functional``): which tensors its modules hold
(``NetBinding``), the hooks that refuse its own forward, ``state_dict`` and ``load_state_dict``
(``Guard``), and the backward through ``apply``'s output that names the way to take the grads
(``refuse_backward``).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils import _pytree as torch_pytree

__all__ = ["NetBinding", "Guard", "refuse_backward"]


class NetBinding:
    """Which tensors ``net``'s modules hold: its own (``Parameter`` objects and buffers) or those
    of the last ``apply``. ``torch.func.functional_call`` puts the given tensors in for the call
    and its own back when the forward returns; activation checkpointing
    (``torch.utils.checkpoint``, HF's ``gradient_checkpointing_enable``) runs the forward of a
    block again inside *backward*, after ``apply`` returned, and would then compute with the
    net's own weights: wrong grads, or a dtype mismatch with the saved activations. So ``apply``
    leaves its tensors in the modules' slots until the next ``apply`` or the way back
    (``state_dict``/``load_into``, which put the net's own back); meanwhile ``Guard`` refuses
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


class Guard:
    """Hooks on the net that refuse its own forward, ``state_dict`` and ``load_state_dict`` while
    fzero trains it (``held``: from the first ``apply`` until ``load_into``): they would act on
    the weights it had before training, or on tensors ``apply`` left bound (``NetBinding``), and
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
    def install(cls, net: nn.Module) -> "Guard":
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


def refuse_backward(net: nn.Module, out):
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
