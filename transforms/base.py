"""Gradient transformations, optax style: ``GradientTransformation(init, update)``.

``init(params, *, context=None) -> state`` and ``update(updates, state, params=None, **extra) ->
(updates, state)`` are pure functions on pytrees (a single tensor is a pytree of one leaf).
``state`` is built from NamedTuples/tuples/dicts of tensors. Hyperparameters live in the state
as 0-d float64 tensors, so changing one (``set_hyperparams``) never retraces a compiled step. A
hyperparameter that follows a schedule (a scheduled ``lr``) is not stored: the state holds the
schedule's count, its NamedTuple class lists the name in ``SCHEDULED``, and the transform's
``hyperparams`` give the value (``get_hyperparams(state, tx)``).

``context``: ``None`` when ``params`` is the params pytree itself (plain use). A caller that
runs the transform on a flat shard of a pytree -- fzero's engine, on one rank's FP32 shard --
passes a ``ShardContext`` instead, so that per-leaf settings (``masked``'s mask, a weight-decay
mask) still refer to the pytree's leaves. Transforms without per-leaf settings ignore it and
``chain``/``masked`` pass it on; ``resolve_per_leaf`` resolves a setting against it.

``extra`` carries what only the caller can know at each step, e.g. ``grad_norm`` (the global
L2 norm of the gradients over all ranks, computed by fzero's engine). Transforms ignore keys
they do not use.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import optree
import torch

from .scalars import with_host_value
from .validate import Rule, check_number

__all__ = [
    "GradientTransformation",
    "FusedStep",
    "ShardContext",
    "Split",
    "resolve_per_leaf",
    "chain",
    "identity",
    "masked",
    "MaskedState",
    "set_hyperparams",
    "get_hyperparams",
    "iter_hyperparams",
    "register_holder",
    "named_tuples",
    "HYPERPARAM_RULES",
    "apply_updates",
    "leaf_paths",
]


class FusedStep(NamedTuple):
    """What a ``fused`` form returns for one step (see ``GradientTransformation``).

    ``kernel(params, grads, state)``: the update in place, with one of torch's fused kernels,
    on a 1-D FP32 ``params`` tensor, the FP32 ``grads`` times ``grad_scale`` like it (which it
    may overwrite), and the state with its tensors of that shape likewise; elementwise, so the
    caller may run it on consecutive slices of the three (the 0-d work is done once, in
    ``fused``). ``None`` for a transform that only rescales the grads. ``state``: the new state;
    its tensors shaped like the params are the ones ``kernel`` writes. ``grad_scale``: what the
    kernel divides the grads by (clipping multiplies it). ``adamw``: for AdamW on FP32 moments,
    a function of no arguments that computes this step's ``[8]`` FP32 coefficients ``(1 - b1,
    b2, 1 - b2, eps, 1 / (1 - b1^t), 1 / sqrt(1 - b2^t), -lr, weight_decay)``, each as ``update``
    computes it: what a kernel of the caller's own may run instead of ``kernel`` on the state's
    two ``[S]`` tensors, the first and second moments (fzero's CPU kernel, which reads the grads
    and writes the params in FP16 or BF16); else ``None``."""

    kernel: Callable[[torch.Tensor, torch.Tensor, Any], None] | None
    state: Any
    grad_scale: torch.Tensor
    adamw: Callable[[], torch.Tensor] | None = None


class GradientTransformation(NamedTuple):
    """``init(params, *, context=None) -> state``; ``update(updates, state, params=None,
    **extra) -> (updates, state)`` (see the module docstring).

    ``fused`` (optional): the same transformation as an in-place step with one of torch's fused
    kernels, for callers that hold the params as one flat FP32 tensor (fzero's engine, eager):
    ``fused(state, *, grad_scale, found_inf, grad_norm) -> FusedStep``, or ``None`` when it
    cannot run fused (then use ``update``): it decides before anything is written. ``grad_scale``
    (0-d FP32): the kernel divides the grads by it; ``found_inf`` (0-d bool) makes the step a
    no-op, as in ``update`` + a select. A transform whose kernel updates the params marks its
    function ``updates_params = True``; ``chain`` composes fused forms when only its last member
    does (the others rescale ``grad_scale``).

    ``hyperparams`` (optional): ``state -> {name: 0-d tensor}``, the values the next update
    applies that are not stored as such, e.g. a schedule's learning rate at the state's count
    (``{"lr": schedule(count)}``); ``chain`` and ``masked`` pass their members' on. A caller
    may check them (fzero's engine skips a step whose values are not finite) or report them.

    ``block``: how many consecutive elements of a flat params tensor the state groups together
    (8-bit moments keep one scale per block: ``transforms.quantize.BLOCK``); 1 for an
    elementwise state. A caller running the transform on a flat shard gives it a whole number
    of blocks, and cuts it into chunks only at block edges (fzero's engine aligns every rank's
    slice to it); the state then holds ``[S]`` tensors, ``[S / block]`` per-block tensors and
    0-d ones. ``chain`` takes the least common multiple of its members'.

    ``needs_context``: the update is not elementwise on a flat tensor standing for the params
    (it groups leaves, or needs each leaf whole): a caller that runs it on such a tensor passes
    the ``ShardContext`` it gave ``init`` to every ``update`` as ``context=``, and never cuts
    the tensor into chunks. ``chain`` and ``masked`` need it when a member does."""

    init: Callable[..., Any]
    update: Callable[..., tuple[Any, Any]]
    fused: Callable[..., Any] | None = None
    hyperparams: Callable[[Any], dict] | None = None
    block: int = 1
    needs_context: bool = False


class ShardContext:
    """What a transform gets as ``context=`` when the tensor it runs on is not the params pytree
    but stands for (a shard of) it, e.g. one rank's flat FP32 shard under fzero's engine.
    ``None`` (the default) means the params are the pytree itself. ``init`` always gets it; a
    transform that declares ``needs_context`` gets the same context in every ``update`` too.

    ``tree``: the params pytree the tensor stands for (shapes matter; values may be
    placeholders), what a mask callable is applied to; leaves the tensor holds nothing of are
    ``None``. ``to_shard(per_leaf)``: a pytree like ``tree`` of per-leaf values (bools, or bool
    tensors broadcastable to each leaf) -> a bool tensor laid out like the tensor.

    Two more methods serve transforms that are not elementwise (``partition``, Muon); this base
    class, for callers that only lay out masks, raises ``NotImplementedError`` in both:

    * ``split(labels_of) -> Split``: the tensor's elements grouped by the label of their leaf
      (``labels_of(tree)``: one string per leaf of ``tree``, in leaf order; called once, the
      same ``labels_of`` then gives the same ``Split``), each group compacted into a tensor of
      its own with a context of its own;
    * ``whole(x, fn, *, dtype=None)``: ``x`` laid out like the tensor -> a tensor laid out the
      same, in ``dtype`` (default ``x.dtype``), where each leaf's elements are those of
      ``fn(that leaf of x, whole, in its shape)`` (padding: zero). The caller gathers each leaf
      whole however it holds them (fzero: through its communicator); the transform stays
      blind to ranks."""

    def __init__(self, tree: Any, to_shard: Callable[[Any], torch.Tensor]):
        self.tree, self.to_shard = tree, to_shard

    def split(self, labels_of) -> "Split":
        raise NotImplementedError(f"{type(self).__name__} cannot group the elements by leaf (split)")

    def whole(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], *, dtype=None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} cannot gather whole leaves (whole)")


class Split(NamedTuple):
    """``ShardContext.split``'s result. ``parts``: ``{label: ShardContext}`` of each group's
    compacted tensor (labels no leaf has are absent); ``take(x)``: ``x`` laid out like the
    split tensor -> ``{label: that group's compacted tensor}``; ``join(parts)``: the inverse,
    ``{label: tensor}`` for every label of ``parts`` -> one tensor laid out like the split one
    (padding zero)."""

    parts: dict
    take: Callable[[torch.Tensor], dict]
    join: Callable[[dict], torch.Tensor]


def resolve_per_leaf(setting, params, context: ShardContext | None = None):
    """A per-leaf ``setting`` laid out like ``params``, the params a transform runs on.

    ``setting``: a pytree like the params pytree (of bools, or bool tensors broadcastable to
    each leaf), or a callable ``params pytree -> such a pytree``. Without ``context``
    ``params`` is that pytree: the callable is applied to it, and the pytree is returned as
    is. With one, the callable is applied to ``context.tree`` and the result goes through
    ``context.to_shard`` (a tensor like ``params``). Call it in ``init``, once."""
    tree = params if context is None else context.tree
    value = setting(tree) if callable(setting) else setting
    return value if context is None else context.to_shard(value)


class EmptyState(NamedTuple):
    pass


def identity() -> GradientTransformation:
    """Leaves updates unchanged."""

    def init(params, *, context: ShardContext | None = None):
        return EmptyState()

    def update(updates, state, params=None, **extra):
        return updates, state

    return GradientTransformation(init, update)


def chain(*txs: GradientTransformation) -> GradientTransformation:
    """Apply ``txs`` in order; the state is a tuple of their states. ``init`` gives each the
    same ``context``."""

    def init(params, *, context: ShardContext | None = None):
        return tuple(tx.init(params, context=context) for tx in txs)

    def update(updates, state, params=None, **extra):
        new_state = []
        for tx, s in zip(txs, state):
            updates, s = tx.update(updates, s, params, **extra)
            new_state.append(s)
        return updates, tuple(new_state)

    def fused(state, *, grad_scale, found_inf, grad_norm):
        new_state, kernel, adamw, at = [], None, None, 0
        for i, (tx, s) in enumerate(zip(txs, state)):
            out = tx.fused(s, grad_scale=grad_scale, found_inf=found_inf, grad_norm=grad_norm)
            if out is None:  # declined: nothing has been written yet
                return None
            new_state.append(out.state)
            grad_scale, kernel, adamw, at = out.grad_scale, out.kernel, out.adamw, i
        last = kernel and (lambda params, grads, s: kernel(params, grads, s[at]))
        return FusedStep(last, tuple(new_state), grad_scale, adamw)

    def hyperparams(state):
        return {k: v for tx, s in zip(txs, state) if tx.hyperparams for k, v in tx.hyperparams(s).items()}

    hyper = hyperparams if any(tx.hyperparams for tx in txs) else None
    block = math.lcm(*(tx.block for tx in txs)) if txs else 1
    # A member that updates the params must be the last one: a member after it would transform
    # updates that its kernel never produces.
    every_fused = bool(txs) and all(tx.fused is not None for tx in txs)
    needs = any(tx.needs_context for tx in txs)
    if every_fused and not any(updates_params(tx.fused) for tx in txs[:-1]):
        fused.updates_params = updates_params(txs[-1].fused)
        return GradientTransformation(init, update, fused, hyper, block, needs)
    return GradientTransformation(init, update, None, hyper, block, needs)


def updates_params(fused) -> bool:
    """Whether a ``fused`` form may update the params in place (marked ``updates_params = True``),
    rather than only rescale the grads (clipping)."""
    return getattr(fused, "updates_params", False)


class MaskedState(NamedTuple):
    """``inner``: the wrapped transform's state. ``mask``: the mask as ``resolve_per_leaf``
    gives it: a pytree of bools like the params (plain use) or, with a ``ShardContext``, a bool
    tensor laid out like the params (under fzero's engine the ``[S]`` shard, 1 byte/element)."""

    inner: Any
    mask: Any


def masked(inner: GradientTransformation, mask) -> GradientTransformation:
    """Apply ``inner`` only where ``mask`` is True; elsewhere updates pass through unchanged.

    ``mask``: a pytree of bools (or bool tensors broadcastable to each leaf) with the params'
    structure, or a callable ``params -> such a pytree``, e.g. ``lambda p: tree_map(lambda x:
    x.ndim > 1, p)`` for "no weight decay on biases and norm gains". It always refers to the
    params *pytree*: ``init(params, *, context=None)`` resolves it once with
    ``resolve_per_leaf`` (with a ``ShardContext``, against ``context.tree``, laid out by
    ``context.to_shard``) and passes ``context`` on to ``inner``.
    """

    def init(params, *, context: ShardContext | None = None):
        return MaskedState(inner.init(params, context=context), resolve_per_leaf(mask, params, context))

    def update(updates, state, params=None, **extra):
        new, inner_state = inner.update(updates, state.inner, params, **extra)

        def pick(m, n, u):
            return torch.where(m, n, u) if isinstance(m, torch.Tensor) else (n if m else u)

        if isinstance(state.mask, torch.Tensor):
            chosen = optree.tree_map(lambda n, u: pick(state.mask, n, u), new, updates)
        else:
            chosen = optree.tree_map(pick, state.mask, new, updates)
        return chosen, MaskedState(inner_state, state.mask)

    hyperparams = inner.hyperparams and (lambda state: inner.hyperparams(state.inner))
    return GradientTransformation(init, update, None, hyperparams, inner.block, inner.needs_context)


def _finite_at_least_0(v: float) -> bool:
    return math.isfinite(v) and v >= 0


# The valid range of each hyperparameter the built-in transforms keep in their states (the same
# ranges torch.optim checks, and finite), as ``transforms.validate`` rules: factories check their
# arguments against it, and ``set_hyperparams`` checks new values of these names.
HYPERPARAM_RULES: dict[str, Rule] = {
    "lr": (_finite_at_least_0, "a finite number >= 0"),
    "b1": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    "b2": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    "eps": (_finite_at_least_0, "a finite number >= 0"),
    "weight_decay": (_finite_at_least_0, "a finite number >= 0"),
    "momentum": (_finite_at_least_0, "a finite number >= 0"),
    "max_norm": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
}


def apply_updates(params, updates):
    """``params + updates``, leaf by leaf, in each param's dtype."""
    return optree.tree_map(lambda p, u: (p + u).to(p.dtype), params, updates)


def named_tuples(tree):
    """Yield every NamedTuple node of ``tree`` (depth first): the state NamedTuples of a
    transform state, e.g. to find its ``MaskedState`` nodes."""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        yield tree
    if isinstance(tree, (tuple, list)):
        for child in tree:
            yield from named_tuples(child)
    elif isinstance(tree, dict):
        for child in tree.values():
            yield from named_tuples(child)


# A caller's state class whose instances hold a transform's state beside state of the caller's
# own (fzero's ZeroState: the master shard and the transform state) -> the function that hands
# out the transform state (``register_holder``).
_HOLDERS: dict[type, Callable[[Any, str], Any]] = {}


def register_holder(cls: type, transform_state: Callable[[Any, str], Any]) -> None:
    """Have ``get_hyperparams``, ``iter_hyperparams`` and ``set_hyperparams`` take an instance of
    ``cls``, a caller's state that holds a transform's state (fzero registers its ``ZeroState``):
    ``transform_state(holder, where)`` returns that transform state, or raises naming ``where``
    (the function called) if the holder may not be read any more (fzero: a state that a
    donating step consumed)."""
    _HOLDERS[cls] = transform_state


def _transform_state(state, where: str):
    """The transform state ``state`` is or holds (``register_holder``)."""
    read = _HOLDERS.get(type(state))
    return state if read is None else read(state, where)


def iter_hyperparams(state):
    """Yield ``(name, tensor)`` for every stored hyperparameter of ``state`` -- a 0-d tensor field
    named in a state NamedTuple's ``HYPERPARAMS`` -- depth first, one pair per field (two
    transforms with an ``lr`` give two pairs): the optimizer's configuration that checkpoints
    keep and ``set_hyperparams`` changes. A scheduled value is none of them (see
    ``get_hyperparams``). ``state``: a transform's state, or a holder of one (fzero's engine
    state, see ``register_holder``)."""
    for node in named_tuples(_transform_state(state, "iter_hyperparams")):
        for name in getattr(type(node), "HYPERPARAMS", ()):
            yield name, getattr(node, name)


def get_hyperparams(state, tx: GradientTransformation | None = None) -> dict[str, torch.Tensor]:
    """Every hyperparameter by name (depth first, the last of equal names wins): the stored ones
    (``iter_hyperparams``) and, given the transform ``tx`` that built ``state``, the values its
    ``hyperparams`` compute from the state, such as a scheduled ``lr``: ``schedule(count)`` at
    the state's count of applied updates, the value the next update applies and fzero's engine
    reports as that step's ``info["lr"]`` (like torch's ``scheduler.get_last_lr()``). 0-d
    tensors, computed with tensor ops: no host sync. ``state``: the transform's state, or a
    holder of one (``register_holder``): fzero's engine state as ``init`` and ``step`` return it,
    or its ``tx_state``."""
    state = _transform_state(state, "get_hyperparams")
    out = dict(iter_hyperparams(state))
    if tx is not None and tx.hyperparams is not None:
        out.update(tx.hyperparams(state))
    return out


def set_hyperparams(state, **values):
    """A copy of ``state`` with the named hyperparameters replaced (e.g. ``lr=3e-4``).

    Values become 0-d tensors (dtype of the old value) on the old value's device; the state's structure is
    unchanged, so a compiled step keeps its graph. Only stored hyperparameters can be set
    (``iter_hyperparams``): a name that follows a schedule in ``state`` (a scheduled ``lr``) raises
    ``ValueError`` saying so; other unknown names raise ``KeyError`` naming the ones
    there are. New values of
    the built-in names are checked like the factories' arguments (``lr``, ``eps``,
    ``weight_decay``, ``momentum`` finite and >= 0; ``b1``, ``b2`` in [0, 1); ``max_norm`` finite
    and > 0), Python numbers and tensors alike (a tensor is read on the host: call this between
    steps, not inside one); a value out of range raises ``ValueError`` and changes nothing.
    ``state``: a transform's state, or a holder of one (``register_holder``: fzero's engine
    state), returned with the same structure.
    """
    _transform_state(state, "set_hyperparams")  # a holder that may not be read raises
    for node in named_tuples(state):
        for name in sorted(set(values) & set(getattr(type(node), "SCHEDULED", ()))):
            raise ValueError(f"set_hyperparams: {name} follows a schedule (the state stores its count only, in "
                             f"{type(node).__name__}), which set_hyperparams cannot change: build the transform with a "
                             f"new schedule, or with a constant {name} to set it between steps")
    stored = {name for name, _ in iter_hyperparams(state)}
    unknown = set(values) - stored
    if unknown:
        raise KeyError(f"no hyperparameter(s) {sorted(unknown)} in state; have {sorted(stored)}")
    checked = {}
    for name, value in values.items():
        checked[name] = check_number("set_hyperparams", name, value, HYPERPARAM_RULES[name]) if name in HYPERPARAM_RULES else float(value)

    def rebuild(node):
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            fields = {f: rebuild(getattr(node, f)) for f in node._fields}
            for name in getattr(type(node), "HYPERPARAMS", ()):
                if name in values:
                    old = fields[name]
                    new = torch.as_tensor(values[name], dtype=old.dtype, device=old.device).reshape(())
                    fields[name] = with_host_value(new.clone() if new is values[name] else new, checked[name])
            return type(node)(**fields)
        if isinstance(node, (tuple, list)):
            return type(node)(rebuild(c) for c in node)
        if isinstance(node, dict):
            return {k: rebuild(v) for k, v in node.items()}
        return node

    return rebuild(state)


def _entry_name(entry: Any) -> str:
    field = getattr(entry, "field", None)  # a NamedTuple field or an attribute: by name
    return str(entry.entry if field is None else field)


def leaf_paths(tree: Any) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """``(paths, leaves, treespec)`` with paths like ``"blocks/0/attn/qkv_w"``: dict keys,
    sequence indices and NamedTuple field names (``"tx_state/0/mu"``) joined by ``/``; the one
    way fzero names a leaf, in errors and in checkpoints (``fzero.flat.leaf_paths``)."""
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree)
    return ["/".join(_entry_name(e) for e in acc) or "<root>" for acc in accessors], leaves, spec
