"""The compiled step's update from a grads pytree, leaf by leaf, as one opaque op.

Compiled from a grads pytree at world size 1 on a CPU, for ``MIN_NUMEL`` elements or more in
leaves of ``MIN_MEAN_NUMEL`` or more on average (``worthwhile``: the host time per leaf this
takes would not be repaid by small leaves or a small model, nor hidden by a GPU's kernels), or
for ``NATIVE_MIN_NUMEL`` elements whatever the leaves where fzero's own CPU kernel runs the
donated update (``fzero.cpu.kernel.native_runs``: the step then calls it as on the flat buffer,
one call over the grad leaves as they lie, ``fzero.cpu.kernel.Native``; this module's op is the
other transforms' path and the pure step's), the update reads each grad leaf and writes each
leaf's slice of the flat FP32 state. Inside one graph neither is cheap on a CPU: inductor lowers
the leaves' concatenation to a copy into a new buffer (its CPU ``cat`` never fuses into the
consumer), and a write into a slice of a graph input becomes, after functionalization, one
masked pass over the whole state per leaf. So the step hands the update to a custom op, which
the traced graph keeps whole:
``fzero::update_leaves`` (``donate=True``) mutates the master, the transform's ``[S]`` state and
the params' flat buffer; ``fzero::updated_leaves`` (the pure step) returns new ones, each
written once. Its body cuts each leaf's slices outside any graph and passes them, each an input
of its own, to graphs compiled at the first step (``torch.compile`` of ``_update_leaves``): one
loop per leaf, reading the grad leaf and writing master, moments and params, as the eager step's
compiled chunks do (``fzero.cpu.chunked.compiled_chunks``). The leaves go in groups of at most
``GROUP``, each group a call of one graph with dynamic sizes: a model of hundreds of leaves
compiles a graph or two of ``GROUP`` loops, not one loop per leaf in one graph, which took
several times as long to compile (``benchmarks/step.py``, docs/performance.md).

A custom op's schema carries tensors and numbers; the transform and its state's structure reach
the body through ``LeafUpdate.key``, the entry each engine makes in ``_UPDATES`` at ``init`` (a
weak dictionary: an engine's entry goes with its ``LeafUpdate``).

The thresholds below come from paired runs against fused AdamW (``benchmarks/step.py``,
``benchmarks/leafwise.py``; the figures in docs/performance.md and benchmarks/results/).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, NamedTuple

import optree
import torch
from torch.fx.experimental import _config as fx_config

from ..cast import IntoLeaves
from ..grad_forms import Segments
from ..memory import check_in_buffer
from ..update import own_compile, update_into

try:  # torch >= 2.5: a pass with a uuid keeps inductor's graph cache on
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover
    CustomGraphPass = object

__all__ = ["LeafUpdate", "CompiledLeaves", "GROUP", "MIN_MEAN_NUMEL", "MIN_NUMEL", "NATIVE_MIN_NUMEL", "worthwhile"]

GROUP = 16  # leaves per call of a compiled graph: compile time grows with it, per-call overhead shrinks
# The mean elements per leaf from which a CPU runs the update leaf by leaf: its host time per
# leaf against the step graph's concatenation and new buffers, per element.
MIN_MEAN_NUMEL = 2**16
# The elements from which it does, whatever the mean: below, the step's graph cost little more
# than the flat buffer (there its concatenation of 2-byte grads is under glibc's largest mmap
# threshold, 32 MiB, and comes back warm from the heap).
MIN_NUMEL = 2**24
# Where fzero's own CPU kernel runs the update (donated: the pure step runs inductor's loops), the
# step calls it once over all the grad leaves where they lie (``fzero.cpu.kernel.Native``): no
# host time per leaf, so no mean size; what is left is the step's own work per leaf (its checks
# of the leaves, dynamo's guards). The elements from which it pays: an FP32 buffer of the shard
# above glibc's largest mmap threshold (32 MiB), which the step's graph may then get as fresh
# pages every step.
NATIVE_MIN_NUMEL = 2**23


def worthwhile(numel: int, leaves: int, *, native: bool = False) -> bool:
    """Whether a CPU's compiled step runs the update of ``leaves`` leaves of ``numel`` elements in
    all leaf by leaf (``fzero.plan`` adds what the path needs of the engine); ``native``:
    fzero's own CPU kernel runs it (``fzero.cpu.kernel.native_runs``)."""
    if native:
        return numel >= NATIVE_MIN_NUMEL
    return numel >= MIN_NUMEL and numel >= MIN_MEAN_NUMEL * leaves


_UPDATES: "weakref.WeakValueDictionary[int, LeafUpdate]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class LeafUpdate:
    """One engine's leaf-by-leaf update: ``tx`` (the transform as it runs on the shard, with
    ``block == 1`` and no ``needs_context``: elementwise on any slice), the structure of its state
    ``spec`` with ``sized[i]`` whether leaf ``i`` is an ``[S]`` tensor (else 0-d), the
    ``param_dtype``, and the graph compiled for them (at the first step)."""

    def __init__(self, tx, spec: optree.PyTreeSpec, sized: tuple[bool, ...], param_dtype: torch.dtype):
        self.tx, self.spec, self.sized, self.param_dtype = tx, spec, sized, param_dtype
        self._compiled: dict[tuple, Any] = {}
        self._dispatch: tuple | None = None
        self.key = next(_KEYS)
        _UPDATES[self.key] = self

    def __call__(self, grads: Segments, mean_factor: torch.Tensor, master: torch.Tensor, tx_state: Any,
                 skip: torch.Tensor, norm: torch.Tensor, into: tuple | None) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """The update of the ``[S]`` shard (the whole buffer at world size 1). ``into``:
        ``(params, leaves, offsets)`` with ``donate``: ``master`` and ``tx_state``'s ``[S]``
        tensors are written in place and the params cast into ``params``, their flat buffer
        (as an ``[S, 1]`` view, ``fzero.cast.IntoLeaves``) whose views the param ``leaves`` must
        be, at ``offsets`` (checked before anything
        is written: ``check_in_buffer``); ``None`` for the pure step: new tensors, the inputs
        untouched. ``grads * mean_factor`` is the FP32 mean unscaled grads
        (``ShardGrads.mean``). Returns ``(master, tx_state, params shard)``; ``tx_state``'s 0-d
        leaves (``count``, ...) are new tensors."""
        state = optree.tree_leaves(tx_state)  # traced: a PyTreeSpec's methods are not
        sized, scalars = [x for x in state if x.ndim], [x for x in state if not x.ndim]
        pieces = (list(grads.parts), list(grads.starts), mean_factor, skip, norm)
        if into is None:
            new = torch.ops.fzero.updated_leaves(self.key, master, sized, scalars, *pieces, self.param_dtype)
            new_sized, new_scalars = iter(new[1:1 + len(sized)]), iter(new[1 + len(sized):-1])
            tx_state = optree.tree_map(lambda x: next(new_sized) if x.ndim else next(new_scalars), tx_state)
            return new[0], tx_state, new[-1]
        params, leaves, offsets = into
        new_scalars = [torch.empty_like(x) for x in scalars]
        torch.ops.fzero.update_leaves(self.key, master, sized, scalars, *pieces, params, leaves, offsets, new_scalars)
        new = iter(new_scalars)
        return master, optree.tree_map(lambda x: x if x.ndim else next(new), tx_state), params

    def compiled(self, kind: tuple):
        """``_update_leaves`` compiled for groups of one ``kind`` (``_groups``: the number of
        pieces, their grads' dtype, whether each holds one element), with dynamic sizes and
        offsets. Each kind has a code object of its own (``own_compile``): a graph each, none a
        recompile of another (which ``error_on_recompile`` would turn into an error)."""
        if kind not in self._compiled:
            self._compiled[kind] = own_compile(_update_leaves, dynamic=True,
                                                options={"post_grad_custom_pre_pass": _SharedScalars()})
        return self._compiled[kind]

    def dispatch_state(self) -> "torch._C._ForceDispatchKeyGuard":
        """The dispatcher's thread-local key sets of the op's first call, restored around every
        later call of the graphs. Dynamo guards a graph on them, and the op's first call in a
        compiled step runs under a dispatch mode that torch's runtime wraps around it (torch 2.13:
        ``_AnalyzeCustomOpInputOutputMode``, which checks custom ops' aliasing once), which
        excludes the keys above its own: without this the second step compiled every graph again
        (twice the compile time). The graphs only call kernels: the keys change nothing they do."""
        if self._dispatch is None:
            self._dispatch = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())
        return torch._C._ForceDispatchKeyGuard(*self._dispatch)


class _SharedScalars(CustomGraphPass):
    """Common-subexpression elimination of a graph's post-grad form (inductor's
    ``post_grad_custom_pre_pass``, where the graph is functional but for the copies into mutated
    inputs at its end). Each leaf's update computes the same 0-d values (``count + 1``, the bias
    corrections, ``transforms.scalar``'s materialized sums) from the same inputs, and AOT
    autograd eliminates common subexpressions only of training graphs: inductor computed them
    once per leaf (on a CPU, each a barrier between the threads; on a GPU, a kernel launch).
    Merged are nodes of the same op on the same arguments, unless the op mutates, draws random
    numbers, or its result is written by another op."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen = {}
        for node in list(graph.nodes):
            op = node.target
            if (node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op._schema.is_mutable
                    or torch.Tag.nondeterministic_seeded in op.tags or _written(node)):
                continue
            key = (op, repr(node.args), repr(node.kwargs))  # nodes print as their unique names
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
            else:
                seen[key] = node

    def uuid(self) -> str:
        return "fzero.cpu.leafwise._SharedScalars.2"


def _written(node: torch.fx.Node) -> bool:
    """Whether one of ``node``'s users writes into it (an argument its schema marks ``a!``)."""
    for user in node.users:
        op = user.target
        if isinstance(op, torch._ops.OpOverload) and op._schema.is_mutable:
            given = {**dict(zip((a.name for a in op._schema.arguments), user.args)), **user.kwargs}
            if any(given.get(a.name) is node for a in op._schema.arguments if a.alias_info and a.alias_info.is_write):
                return True
    return False


def _update_leaves(tx, grads, mean_factor, ins, params, skip, norm, param_dtype, outs=None):
    """``update_into`` of each piece: ``grads[i]`` (1-D, any float dtype) times
    ``mean_factor`` on ``ins[i] = (master, tx_state)``, slices of the state, written into
    ``outs[i]`` (slices of new tensors; ``None``: into ``ins[i]``, in place), the params cast
    into ``params[i]``. Returns the new state's 0-d leaves (every piece computes the same ones)."""
    norm = norm.reshape(())  # the 0-d norm, given as [1] (see ``_run``)
    scalars = []
    for g, (master, tx_state), out, p in zip(grads, ins, ins if outs is None else outs, params):
        scalars = update_into(tx, g.float() * mean_factor, master, tx_state, skip, norm, param_dtype,
                               (*out, p), traced=True)
    return scalars


def _run(key: int, master, state, scalars, grads, starts, mean_factor, skip, norm, params, into=None) -> list:
    """Both ops' work: the update of ``master`` and the ``[S]`` ``state`` (with the 0-d
    ``scalars``, the state's leaves in ``LeafUpdate.sized`` order), one piece per grads piece
    (``grads[i]`` holds elements from ``starts[i]``, in any order; the elements between pieces,
    padding, from zero grads, as the flat step updates them), written into ``into = (master,
    state)``, ``[S]`` tensors (``None``: in place), the params cast into ``[S]`` ``params``.
    Returns the new 0-d leaves.

    The in-place and the pure update call differently shaped graphs (``outs`` given or not),
    never one graph with its inputs aliased in two ways: torch's AOT autograd cache (torch 2.13)
    keyed the two alike, and a pure step given the in-place graph from the cache wrote nothing."""
    u = _UPDATES[key]
    zeros = (grads[0] if grads else master).new_zeros  # padding's grads: of the grads' dtype, to share their graph
    pieces, pos = [], 0
    for s, g in sorted(zip(starts, grads), key=lambda sg: sg[0]):
        if s > pos:
            pieces.append((pos, zeros(s - pos)))
        if g.numel():
            pieces.append((s, g.reshape(-1)))
        pos = s + g.numel()
    if pos < master.numel():
        pieces.append((pos, zeros(master.numel() - pos)))

    def tree(sized, lo, hi):  # the transform state of elements [lo, hi)
        sized, scalar = iter(sized), iter(scalars)
        return u.spec.unflatten([next(sized)[lo:hi] if s else next(scalar) for s in u.sized])

    new_scalars = []
    # The norm as a [1] tensor: dynamo traces a 0-d float64 CPU input as a symbolic float, guarded
    # on not being NaN, and the first step with a NaN grad (its norm NaN) compiled every graph again.
    norm = norm.reshape(1)
    # No duck shapes: a slice's offset that equals another leaf's size is then no guard (a torch
    # without the option recompiles such a group instead).
    no_duck = (fx_config.patch(use_duck_shape=False) if hasattr(fx_config, "use_duck_shape")
               else contextlib.nullcontext())
    with u.dispatch_state(), torch.no_grad(), no_duck:
        for kind, group in _groups(pieces):
            spans = [(lo, lo + g.numel()) for lo, g in group]
            ins = [(master[lo:hi], tree(state, lo, hi)) for lo, hi in spans]
            outs = None if into is None else [(into[0][lo:hi], tree(into[1], lo, hi)) for lo, hi in spans]
            new_scalars = u.compiled(kind)(u.tx, [g for _, g in group], mean_factor, ins,
                                           [params[lo:hi] for lo, hi in spans], skip, norm, u.param_dtype, outs)
    return new_scalars


def _groups(pieces: list) -> list[tuple[tuple, list]]:
    """``pieces`` (``(start, 1-D grad)``) in groups of at most ``GROUP`` of one kind, in memory
    order within a kind, each as ``(kind, group)``: ``kind`` = (the group's length, its grads'
    dtype, whether they hold one element each). The groups of a kind share a graph with
    dynamic sizes; dynamo specializes a size of 1 (and a dtype), so those make kinds of their
    own: a graph for full groups and one for the rest, per kind."""
    kinds: dict[tuple, list] = {}
    for lo, g in pieces:
        kinds.setdefault((g.dtype, g.numel() == 1), []).append((lo, g))
    return [((len(run[i:i + GROUP]), *k), run[i:i + GROUP]) for k, run in kinds.items()
            for i in range(0, len(run), GROUP)]


@torch.library.custom_op("fzero::update_leaves", mutates_args=("master", "state", "params", "new_scalars"))
def _update_leaves_op(key: int, master: torch.Tensor, state: list[torch.Tensor], scalars: list[torch.Tensor],
                      grads: list[torch.Tensor], starts: list[int], mean_factor: torch.Tensor, skip: torch.Tensor,
                      norm: torch.Tensor, params: torch.Tensor, param_leaves: list[torch.Tensor], offsets: list[int],
                      new_scalars: list[torch.Tensor]) -> None:
    """The donated update (``_run``) in place: ``master``, ``state`` and ``params`` (``[S, 1]``,
    see ``fzero.cast.IntoLeaves``) written; ``param_leaves`` must be views of ``params`` at
    ``offsets`` (``check_in_buffer``). ``scalars``: the state's 0-d leaves, read;
    ``new_scalars``: written with their new values (a custom op that mutates its inputs cannot
    also return a list)."""
    params = params.view(-1)
    check_in_buffer(params, param_leaves, offsets)
    for out, x in zip(new_scalars, _run(key, master, state, scalars, grads, starts, mean_factor, skip, norm, params)):
        out.copy_(x)


@_update_leaves_op.register_fake
def _(key, master, state, scalars, grads, starts, mean_factor, skip, norm, params, param_leaves, offsets, new_scalars):
    return None


@torch.library.custom_op("fzero::updated_leaves", mutates_args=())
def _updated_leaves_op(key: int, master: torch.Tensor, state: list[torch.Tensor], scalars: list[torch.Tensor],
                       grads: list[torch.Tensor], starts: list[int], mean_factor: torch.Tensor, skip: torch.Tensor,
                       norm: torch.Tensor, param_dtype: torch.dtype) -> list[torch.Tensor]:
    """The pure update (``_run``) into new tensors, written once each: returns the new master,
    the new ``state`` and ``scalars``, and the params shard in ``param_dtype``."""
    into = (torch.empty_like(master), [torch.empty_like(x) for x in state])
    params = torch.empty(master.numel(), dtype=param_dtype, device=master.device)
    new = _run(key, master, state, scalars, grads, starts, mean_factor, skip, norm, params, into)
    # 0-d leaves cloned: one the transform passes through would alias an input
    return [into[0], *into[1], *[x.clone() for x in new], params]


@_updated_leaves_op.register_fake
def _(key, master, state, scalars, grads, starts, mean_factor, skip, norm, param_dtype):
    # (``key`` may be a symbol here: dynamo makes an engine attribute that differs from engine
    # to engine dynamic; nothing of the engine is needed for the shapes)
    return [torch.empty_like(master), *[torch.empty_like(x) for x in state], *[torch.empty_like(x) for x in scalars],
            master.new_empty(master.numel(), dtype=param_dtype)]


class CompiledLeaves(NamedTuple):
    """The compiled step from a grads pytree at world size 1: the update as one opaque op that
    runs a compiled loop per grad leaf, reading each where it is (``leaves``, the engine's
    ``LeafUpdate``). ``into``: donated, master and moments written in place and the params cast
    into their own buffer; ``None``: pure, into new tensors, each written once. The grads' mean is
    taken as ``ShardGrads.mean`` takes it."""

    leaves: LeafUpdate
    into: IntoLeaves | None = None

    def run(self, tx, grads, master, tx_state, skip, norm):
        return self.leaves(grads.segments(), grads.mean_factor, master, tx_state, skip, norm, self.into)
