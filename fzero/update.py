"""The update on this rank's FP32 shard: transform -> keep the old values where the step is
skipped -> cast to the param dtype.

The transforms are elementwise on the shard (a rank holds arbitrary slices of params, so they
must be; the one global quantity, the grad norm, comes in as an argument), so the shard may be
cut into chunks. Eager, each op of the update allocates a temporary: at shard size those are
fresh pages from the OS every op (924 vs 390 ms for 2e7 elements on a 2-core CPU); at
``chunk_numel`` they stay in cache and the allocator reuses them. A transform with a fused form
runs its kernel the same way, chunk by chunk, reading the grads a chunk at a time. Compiled,
inductor fuses the update into one loop, so it runs on the whole shard.
"""
from __future__ import annotations

import types

from typing import Any, NamedTuple

import optree
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fzero.transforms import FusedStep, scalar

from . import native as native_kernel
from .flat import tree_leaves
from .grads import Reduced, Segments
from .mode import StepMode, compiling
from .remainder import round_bf16

__all__ = ["ShardGrads", "choose", "fused_chunks", "generic_chunks", "compiled_chunks", "generic_whole", "compiled_whole",
           "compiled_leaves", "compiled_update", "CompiledUpdate", "COMPILE_NUMEL", "sum_of_squares", "cast_params", "write_into", "NORM_BLOCK", "NORM_ROW"]


def cast_params(master: torch.Tensor, dtype: torch.dtype, *, copy: bool = False,
                out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 master values in the param ``dtype``, *saturating*: values beyond the dtype's
    finite range (65504 for FP16) become its largest finite value instead of inf, so a finite
    master never gives a non-finite param. The master keeps the exact value; NaN stays NaN.
    ``copy``: a new tensor even when ``dtype`` is FP32; ``out``: written into that tensor
    (of ``dtype``, like ``master``) and returned; ``scratch``: an FP32 tensor like ``master``
    that may be overwritten, where the saturation then runs before the cast (the same bits:
    the largest finite value rounds to itself, and whatever lies beyond it rounds to it or to
    inf), because a CPU clamps FP32 faster than FP16 or BF16 (the eager step's chunks,
    ``fused_chunks``)."""
    if dtype == master.dtype:
        return out.copy_(master) if out is not None else master.clone() if copy else master
    big = torch.finfo(dtype).max
    if scratch is not None:
        master = torch.clamp(master, -big, big, out=scratch)
    # BF16: to nearest, ties away from zero, the rounding under which (BF16, int16 remainder)
    # splits the FP32 master exactly (fzero.remainder); FP16: torch's cast (ties to even).
    rounded = round_bf16(master) if dtype == torch.bfloat16 else master
    cast = rounded.to(dtype) if out is None else out.copy_(rounded)
    return cast if scratch is not None else cast.clamp_(-big, big)  # +-inf -> +-max; NaN stays NaN


def write_into(old: Any, new: Any) -> Any:
    """Copy every tensor of ``new`` into the matching tensor of ``old`` (pytrees, or lists of
    leaves); return ``old``.

    Under ``torch.compile`` inductor stores the step's results straight into the input
    buffers, so the FP32 state is never held twice."""
    for o, n in zip(tree_leaves(old), tree_leaves(new)):
        if o is not n:  # updated in place already (the fused kernel)
            o.copy_(n)
    return old


def _update(tx, g, master, tx_state, skip, norm, param_dtype):
    """The update of (a chunk of) the shard: ``(master, tx_state, master in param_dtype)``."""
    updates, new_tx_state = tx.update(g, tx_state, master, grad_norm=norm)
    # Skip without a branch: on overflow every state tensor keeps its old bits.
    new_master = torch.where(skip, master, master + updates)
    new_tx_state = optree.tree_map(lambda new, old: _keep_if(skip, old, new), new_tx_state, tx_state)
    return new_master, new_tx_state, cast_params(new_master, param_dtype)


def _update_into(tx, g, master, tx_state, skip, norm, param_dtype, outs):
    """``_update`` of a chunk written into ``outs``, the chunk's slices of the full-size outputs
    ``(master, tx_state, params shard)`` (with ``donate``, the very tensors given as ``master``
    and ``tx_state``): returns the new state's 0-d leaves (``count``, ...), in order."""
    new = _update(tx, g, master, tx_state, skip, norm, param_dtype)
    scalars = []
    for o, n in zip(optree.tree_leaves(outs), optree.tree_leaves(new)):
        if o.ndim:
            o.copy_(n)
        else:
            scalars.append(n)
    return scalars


class CompiledUpdate(NamedTuple):
    """An engine's compiled updates: ``whole`` is ``_update`` (``compiled_whole``), ``into`` is
    ``_update_into`` (``compiled_chunks``), ``leaves`` the engine's ``fzero.leafwise.LeafUpdate``
    (``compiled_leaves``; ``None`` where the step never takes it); ``native``: fzero's own CPU
    kernel may run the update (``fzero.native``; decided at ``init``)."""

    whole: Any
    into: Any
    leaves: Any = None
    native: bool = False


def _own_compile(fn, *, dynamic: bool = False, options: dict | None = None):
    """``fn`` under ``torch.compile`` (``dynamic``, inductor ``options``) with a compile cache of
    its own. Dynamo keeps compiled graphs, and its limit of recompiles (8), per code object, and a
    graph is guarded on the chunk's shape and on what the transform holds: one ``_update`` shared
    by every engine of a process failed (``fullgraph=True``) once their shards' shapes had made
    more graphs than that. A copy of the code object per engine keeps each engine's few graphs
    apart."""
    code = fn.__code__.replace()  # a new code object, the same code
    own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(own, fullgraph=True, dynamic=dynamic, options=options)


def compiled_update() -> CompiledUpdate:
    """The compiled updates for ``compiled_chunks`` and ``compiled_whole``: each engine makes its
    own (nothing compiles before the first call)."""
    return CompiledUpdate(_own_compile(_update), _own_compile(_update_into))


def _keep_if(skip: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``torch.where(skip, old, new)``. Compiled, 1-byte tensors (8-bit moments' codes) are
    selected as FP32 values and cast back, the same bits (every int8 and uint8 value is an FP32
    one): inductor's CPU code blends 1-byte lanes under a bool mask converted lane by lane, 20 ms
    for 8.4e6 codes against 2 ms for the select in FP32, which also fuses into the loop that
    computes the codes (``benchmarks/moments.py``: with the codec's reciprocals, the compiled 8-bit
    step went from 4.2x to 3.2-3.4x the FP32-moment one; BF16 moments measured the same either way)."""
    if compiling() and old.element_size() == 1:
        return torch.where(skip, old.float(), new.float()).to(old.dtype)
    return torch.where(skip, old, new)


NORM_BLOCK, NORM_ROW = 2**18, 256  # the eager sum of squares: elements per block, per row
# The grads fzero.native's kernels read (the norm's sum of squares and the AdamW update), and the
# params the update writes
_NATIVE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def sum_of_squares(g: Segments, *, bounded: bool, compiled: bool = False, native: bool = False) -> torch.Tensor:
    """``sum(g**2)`` over the elements of ``g`` as a 0-d float64; non-finite iff some element
    is inf or NaN.

    The norms of rows of ``NORM_ROW`` elements, squared and summed in float64. Eager, the rows
    are those of ``g.pieces(NORM_BLOCK)`` (any cast stays block-sized), the same pieces whether
    ``g`` is a grads pytree or the flat buffer, whatever ``chunk_numel``: so is the result,
    bitwise. ``compiled`` (traced by ``torch.compile``): of the whole parts (inductor fuses the
    cast). Each row's norm is accumulated in

    * FP32 when ``bounded``: every element is a sum of at most 2^30 FP16 values, ranks times
      micro-batches (|g| <= 7e13: squared and summed over a row, far below 3.4e38);
    * FP32, the row first multiplied by ``1 / m``, ``m`` half its mean magnitude (at least its
      largest over ``2 * NORM_ROW``), for BF16 and FP32 grads ``compiled``: every scaled
      element is at most ``2 * NORM_ROW``, so no square can overflow (the grads reach 3.4e38,
      whose square FP32 cannot hold), and the largest at least 2 (a row of tiny or subnormal
      values is multiplied by 2^100), so nothing is lost that the row's norm would show
      (``_scaled_row_sumsq``). Inductor's float64 reduction on CPU takes 2-4x as long; eager,
      the same in small ops would be slower than float64;
    * float64 otherwise (eager BF16 or FP32): it never overflows for finite inputs.

    Each is exact to ~1e-7 relative (a running sum of 256 terms; one over 2^18 terms would lose
    1e-4). ``native`` (eager, CPU grads, ``fzero.native`` built: at the first call; or traced,
    where the step's update runs that kernel leaf by leaf, ``StepMode.native_norm``): the eager
    rows, each row's sum of squares taken in one pass by fzero's kernel in FP32 (``bounded``) or
    float64, with no FP32 or float64 copy of the grads; traced too, the eager step's bits."""
    if native and (compiled or native_kernel.available(torch.device("cpu"))) and all(
            p.dtype in _NATIVE_DTYPES and p.device.type == "cpu" and p.is_contiguous() for p in g.parts):
        return native_kernel.sum_of_squares(g.pieces(NORM_BLOCK), NORM_ROW, wide=not bounded)
    # Each piece's full rows, then every tail that fills no row, zero-padded.
    scaled = compiled and not bounded
    dtype = torch.float32 if bounded or scaled else torch.float64
    rows, tails = [], []
    for p in g.parts if compiled else g.pieces(NORM_BLOCK):
        n = p.numel() // NORM_ROW * NORM_ROW
        rows += [p[:n].view(-1, NORM_ROW)] if n else []
        tails += [p[n:]] if n < p.numel() else []
    if tails:
        pad = -sum(t.numel() for t in tails) % NORM_ROW
        tails = torch.cat([t.to(dtype) for t in tails] + [tails[0].new_zeros(pad, dtype=dtype)])
        rows.append(tails.view(-1, NORM_ROW))
    if scaled:
        # Summed part by part, not concatenated first: the rows' scales and scaled sums of
        # squares then need no buffer, and inductor runs both reductions in one loop over the grads.
        return sum(_scaled_row_sumsq(r).sum() for r in rows)
    norms = [torch.linalg.vector_norm(r, dim=1, dtype=dtype) for r in rows]
    return torch.cat(norms).double().square().sum()


def _scaled_row_sumsq(rows: torch.Tensor) -> torch.Tensor:
    """``[R, NORM_ROW]`` -> ``[R]`` float64 sums of squares, each taken in FP32 of the row
    multiplied by ``s = 1 / m``, ``m`` the sum of its magnitudes over ``2 * NORM_ROW``; then
    divided by ``s**2`` in float64 (the same ``s``: only the FP32 products round, ~1e-7 relative).

    With ``a`` the row's largest magnitude, ``a / (2 * NORM_ROW) <= m <= a / 2``: the scaled
    elements are at most ``2 * NORM_ROW`` and the largest at least 2. ``m`` is kept in
    ``[2**-100, 2**126]``: below (all zeros, or subnormal grads whose terms underflowed),
    ``s = 2**100``, exact, which lifts every subnormal into normal range; above (a finite row
    reaches at most ``2**127``, and only in FP32's top octave), ``s = 2**-126``, under which
    such a row's largest is still at least 2 and at most 4. An inf makes ``m`` inf and ``s``
    ``2**-126``: the sum is inf, as the float64 sum of the squares would be; a NaN makes it NaN.

    The mean magnitude, not the largest: inductor's CPU code takes a max reduction with NaN
    propagation, about twice the vector operations of a sum (the compiled BF16 step on the flat
    buffer, docs/performance.md)."""
    x = rows.float()
    m = (x.abs() * (0.5 / NORM_ROW)).sum(dim=1, keepdim=True).clamp(_MIN_MEAN, _MAX_MEAN)
    s = 1.0 / m
    sumsq = (x * s).square().sum(dim=1)
    return sumsq.double() / s.squeeze(1).double().square()


_MIN_MEAN, _MAX_MEAN = 2.0**-100, 2.0**126  # the row scales' inverses: powers of two, FP32 normals


def _chunks(S: int, chunk: int | None, block: int = 1):
    """``(lo, hi)`` of consecutive chunks of ``chunk`` elements (rounded down to whole
    ``block``s, at least one) covering ``[0, S)``."""
    step = S if not chunk else max(block, chunk // block * block)
    return [(lo, min(S, lo + step)) for lo in range(0, S, step)] or [(0, 0)]


def _per_block(x: Any, S: int, block: int) -> bool:
    """Whether ``x`` is a per-block state tensor of an ``[S]`` shard: ``[S / block]`` (one value
    per ``block`` elements, ``GradientTransformation.block``)."""
    return block > 1 and isinstance(x, torch.Tensor) and x.shape == (S // block,)


def _slices(tree: Any, S: int, block: int, lo: int, hi: int) -> Any:
    """``tree`` with each ``[S]`` tensor cut to ``[lo:hi]`` and each per-block one to
    ``[lo/block : hi/block]`` (``lo``, ``hi``: block edges or ``S``); 0-d leaves as they are."""
    def cut(x):
        if isinstance(x, torch.Tensor) and x.shape == (S,):
            return x[lo:hi]
        return x[lo // block: -(-hi // block)] if _per_block(x, S, block) else x

    return optree.tree_map(cut, tree)


class ShardGrads(NamedTuple):
    """This rank's reduced grads as the update reads them: ``shard * factor`` is the mean over
    ranks of the grads (summed over micro-batches) times ``scale`` (the loss scale);
    ``shard`` is the ``[S]`` tensor, or ``Segments`` of it (the eager fused step).
    ``owned``: ``shard`` is no caller's tensor. ``grad_scale`` (0-d FP32): what the grads are
    divided by to be the mean unscaled grads."""

    shard: torch.Tensor | Segments
    factor: float
    scale: torch.Tensor
    owned: bool
    grad_scale: torch.Tensor

    @classmethod
    def of(cls, reduced: Reduced, scale: torch.Tensor) -> "ShardGrads":
        grad_scale = scalar(scale / reduced.factor)
        return cls(reduced.shard, reduced.factor, scale, reduced.owned, grad_scale)

    def segments(self) -> Segments:
        return self.shard if isinstance(self.shard, Segments) else Segments.of(self.shard, self.owned)

    @property
    def mean_factor(self) -> torch.Tensor:
        """What ``shard`` is multiplied by to be the mean unscaled grads (0-d FP32)."""
        return scalar(self.factor / self.scale)

    def mean(self, device: torch.device, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """The FP32 mean unscaled grads ``[lo:hi]`` (default: all ``[S]``) on ``device``: one
        FP32 multiply; ``Segments`` (read for a fused kernel that declined) divided by
        ``grad_scale`` as the kernel would."""
        if isinstance(self.shard, Segments):
            hi = self.shard.numel if hi is None else hi
            return self.shard.fp32(lo, hi, device) / self.grad_scale.to(device)
        return (self.shard[lo:hi].float() * self.mean_factor).to(device)


# The update variants (like torch.optim's _fused_adamw / _multi_tensor_adamw / _single_tensor_adamw)
# share one signature: ``(tx, fused, grads, master, tx_state, skip, norm, *, param_dtype, chunk,
# donate, out, compiled) -> (master, tx_state, params shard)``. ``fused``: the ``FusedStep`` the transform
# gave for this step (``fused_chunks`` only, else ``None``); ``grads``: ``ShardGrads``; ``skip`` 0-d bool (keep
# every old value); ``norm`` the global grad norm (float64, for clipping); ``chunk``: elements per
# chunk (``None``: the whole shard); ``donate``: write into the inputs' own buffers (else new
# ones: the step stays pure); ``out``: an ``[S]`` ``param_dtype`` tensor to cast the params shard
# into (else a new one); ``compiled``: the engine's ``compiled_update()``, which the compiled
# variants run. Results do not depend on the chunking, and the fused and generic variants agree
# to float rounding.

def fused_chunks(tx, fused: FusedStep, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk,
                 donate, out, compiled=None):
    """torch's fused kernel (one pass over master, grads and moments) chunk by chunk, in place on
    ``master`` and ``tx_state`` (or on copies of their ``[S]`` tensors), reading the grads a chunk
    at a time (``Segments.fp32``), each chunk cast into ``out`` right after."""
    g, S = grads.segments(), master.numel()
    # Chunks (a CPU's) stay in cache: there each chunk's spent FP32 grads take the saturation
    # before the cast (``cast_params``' ``scratch``), 6 B/elem more of traffic in cache, where a
    # whole shard (a GPU's) would pay them in memory.
    saturate_in_grads = chunk is not None
    # Whole multiples of 64 elements: the kernel's vector loop and its scalar tail round
    # differently, so chunk edges elsewhere would change results.
    chunk = S if chunk is None else max(64, chunk // 64 * 64)
    is_shard = lambda x: isinstance(x, torch.Tensor) and x.shape == (S,)
    copy = lambda x: x.clone() if is_shard(x) and x.is_floating_point() else x  # masks are only read
    master, tx_state = (master, tx_state) if donate else optree.tree_map(copy, (master, tx_state))
    out = torch.empty(S, dtype=param_dtype, device=master.device) if out is None else out
    # Every chunk's views made up front (a tree_map per chunk costs more than a small kernel).
    leaves, spec = optree.tree_flatten(tx_state)
    cut = lambda x: x.split(chunk)
    parts = [cut(x) if is_shard(x) else None for x in leaves]
    for i, (m, o) in enumerate(zip(cut(master), cut(out))):
        lo = i * chunk
        state_chunk = spec.unflatten([x if v is None else v[i] for x, v in zip(leaves, parts)])
        grads_chunk = g.fp32(lo, lo + m.numel(), m.device)
        fused.kernel(m, grads_chunk, state_chunk)
        if o.data_ptr() != m.data_ptr():  # else the master is the params (``master="params"``), updated
            cast_params(m, param_dtype, out=o, scratch=grads_chunk if saturate_in_grads else None)
    # the [S] tensors the kernel wrote, the 0-d leaves of the fused step's state
    return master, optree.tree_map(lambda full, new: full if is_shard(full) else new, tx_state, fused.state), out


def generic_whole(tx, fused, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk, donate, out,
                  compiled=None):
    """``tx.update`` on the whole shard at once (compiled: inductor fuses it into one loop)."""
    return _whole(_update, tx, grads, master, tx_state, skip, norm, param_dtype=param_dtype, out=out)


def _whole(update, tx, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, out):
    master, tx_state, shard = update(tx, grads.mean(master.device), master, tx_state, skip, norm, param_dtype)
    return master, tx_state, shard if out is None else out.copy_(shard)


def compiled_whole(tx, fused, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk, donate, out,
                   compiled):
    """``generic_whole`` with the update compiled, for a transform that takes the whole shard
    (``needs_context``: ``partition``, Muon) eager on a large CPU shard: the groups' gathers and
    the elementwise math fused into a few loops instead of one eager pass per op (the small
    GPT's Muon + AdamW step on 2 ranks, ``benchmarks/muon.py``: see docs/muon.md). Compiled once
    per engine (``compiled``), at the first step, as ``compiled_chunks`` is."""
    return _whole(compiled.whole, tx, grads, master, tx_state, skip, norm, param_dtype=param_dtype, out=out)


def generic_chunks(tx, fused, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk, donate, out,
                   compiled=None):
    """``tx.update`` chunk by chunk, written into full-size outputs (the inputs' own buffers with
    ``donate``): eager, each op's temporary stays cache-sized, the grads' mean included."""
    return _by_chunks(_update_into, tx, grads, master, tx_state, skip, norm, param_dtype=param_dtype, chunk=chunk,
                      donate=donate, out=out)


def compiled_chunks(tx, fused, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk, donate,
                    out, compiled):
    """``generic_chunks`` with each chunk's update compiled by ``torch.compile`` (inductor: one
    loop per chunk instead of one eager op after another), for state torch's fused kernels
    cannot take: BF16 or 8-bit moments. Compiled once per chunk shape in each engine
    (``compiled``): the first step pays for it, as torchao's ``AdamW8bit`` compiles its per-parameter step
    (``benchmarks/moments.py``). Chunks are whole blocks, so the results do not depend on the
    chunking. The compiled update writes its results into the chunk's slices of the outputs,
    which are cut outside the graph and passed in (``_update_into``): cut inside the graph,
    inductor (torch 2.13, CPU) left some of them unwritten; returned and copied eagerly, the
    eager 8-bit step measured 2.9x the FP32-moment one instead of 2.2x (``benchmarks/moments.py``;
    ``tests/test_update.py`` holds the results to the eager ones, whatever the chunking)."""
    return _by_chunks(compiled.into, tx, grads, master, tx_state, skip, norm, param_dtype=param_dtype,
                      chunk=chunk, donate=donate, out=out)


def _by_chunks(update_into, tx, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk, donate,
               out):
    """``update_into`` (``_update_into`` or its compiled form) chunk by chunk, into full-size
    outputs made before the first chunk: the inputs' own buffers with ``donate`` (each chunk then
    reads and writes the same slices, passed once)."""
    S, block, device = master.numel(), tx.block, master.device
    sized = lambda x: isinstance(x, torch.Tensor) and (x.shape == (S,) or _per_block(x, S, block))  # noqa: E731
    full = lambda x: (x if donate else torch.empty_like(x)) if sized(x) else x  # noqa: E731
    outs = (full(master), optree.tree_map(full, tx_state), torch.empty(S, dtype=param_dtype, device=device)
            if out is None else out)
    scalars = None
    for lo, hi in _chunks(S, chunk, block):
        sliced = _slices(outs, S, block, lo, hi)
        master_in, state_in = sliced[:2] if donate else (master[lo:hi], _slices(tx_state, S, block, lo, hi))
        scalars = update_into(tx, grads.mean(device, lo, hi), master_in, state_in, skip, norm, param_dtype, sliced)
    # the [S] and per-block tensors written, the 0-d leaves as the last chunk computed them
    scalars = iter(scalars)
    return outs[0], optree.tree_map(lambda o: o if sized(o) else next(scalars), outs[1]), outs[2]


def compiled_leaves(tx, fused, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk, donate,
                    out, compiled):
    """The compiled step from a grads pytree at world size 1 (``mode.leafwise``): the update as
    one opaque op that runs a compiled loop per grad leaf, reading each where it is
    (``fzero.leafwise``). With ``donate``, master and moments are written in place and the
    params cast into their own buffer (``out``: ``(buffer, leaves, offsets)``,
    ``stages.cast_target``); pure, into new tensors, each written once. The grads' mean is taken
    as ``ShardGrads.mean`` takes it."""
    return compiled.leaves(grads.segments(), grads.mean_factor, master, tx_state, skip, norm, out)


def native_update(tx, fused: FusedStep, grads: ShardGrads, master, tx_state, skip, norm, *, param_dtype, chunk,
                  donate, out, compiled=None):
    """The update at world size 1 with fzero's own CPU kernel (``fzero.native``) for AdamW on
    FP32 moments (``fused.adamw``; ``native_fused`` decides): one pass that reads the grads
    where they lie (the flat buffer, or the grad leaves), updates master and moments in place
    and casts the params into ``out``, their own buffer (``donate``; a skipped step writes
    nothing: the params are the master's cast already; compiled from a grads pytree, their
    buffer as ``[S, 1]``, checked by ``stages.update``). ``out is master``: FP32 params that are
    the master itself (``master="params"``, ``stages.update``), written as the master is.
    Pure (eager): the same on copies of master and moments, the params into a new buffer (a
    skipped step: the master's cast). The same bits as ``generic_whole`` compiled."""
    # ``fused.state`` is the new state, its moments the tensors the kernel writes: one traversal
    # of it (traced, each optree call is some 2,500 instructions dynamo interprets).
    new_state = fused.state
    sized = [x for x in optree.tree_leaves(new_state) if x.ndim]
    params_are_master = out is master  # donated only (pure: ``out`` is None)
    if not donate:
        master, sized = master.clone(), [x.clone() for x in sized]
        out = torch.empty(master.shape, dtype=param_dtype, device=master.device)
        copies = iter(sized)
        new_state = optree.tree_map(lambda x: next(copies) if x.ndim else x, new_state)
    out = out[0] if isinstance(out, tuple) else out  # leaf by leaf: (buffer, leaves, offsets), checked by then
    g = grads.segments()
    torch.ops.fzero.adamw_update_(list(g.parts), list(g.starts), fused.adamw(), grads.mean_factor, skip, master, *sized,
                                  None if params_are_master else out, not donate)
    return master, new_state, out


def native_fused(tx, tx_state, parts, numel: int, skip, norm, param_dtype) -> FusedStep | None:
    """The transform's ``FusedStep`` where fzero's own CPU kernel can run it (``native_update``,
    and leaf by leaf ``fzero.leafwise``), else ``None``: AdamW's coefficients given for the grads
    as they are (no clipping before it), two ``[numel]`` FP32 moments, the grads ``parts`` FP16,
    BF16 or FP32 contiguous CPU pieces, FP16, BF16 or FP32 params."""
    if tx.fused is None or param_dtype not in _NATIVE_DTYPES or any(
            p.dtype not in _NATIVE_DTYPES or p.device.type != "cpu" or not p.is_contiguous() for p in parts):
        return None
    sized = [x for x in optree.tree_leaves(tx_state) if x.ndim]
    if len(sized) != 2 or any(x.dtype != torch.float32 or x.shape != (numel,) for x in sized):
        return None
    one = torch.ones((), dtype=torch.float32, device=sized[0].device)
    fused = tx.fused(tx_state, grad_scale=one, found_inf=skip, grad_norm=norm)
    return fused if fused is not None and fused.adamw is not None and fused.grad_scale is one else None


COMPILE_NUMEL = 2**20  # eager shards from this size up compile their update when it has no fused kernel


def _low_precision(tx_state, S: int) -> bool:
    """Whether the transform state holds ``[S]`` tensors below FP32 (BF16 or 8-bit moments)."""
    return any(isinstance(x, torch.Tensor) and x.shape == (S,) and x.dtype in _LOW_PRECISION
               for x in optree.tree_leaves(tx_state))


_LOW_PRECISION = (torch.bfloat16, torch.int8, torch.uint8)  # the moments' dtypes, not a decay mask's bool


def choose(mode: StepMode, tx, tx_state, grads: ShardGrads, skip, norm, numel: int, *,
           param_dtype: torch.dtype | None = None):
    """``(variant, fused)`` for this step's update of an ``[numel]`` shard: ``fused_chunks`` with
    the transform's ``FusedStep`` when the step is fused and the transform does not decline it
    (it decides from its state, before anything is written; ``skip``/``norm`` on the state
    device), else ``generic_chunks`` or ``generic_whole`` (``mode.chunk``), with ``None``;
    ``compiled_chunks`` instead of ``generic_chunks`` for BF16 or 8-bit state on a shard of at
    least ``COMPILE_NUMEL`` elements (below that, compiling costs more than it saves) when no
    ``TorchDispatchMode`` is active (a counter or a debug mode sees the eager ops). A transform
    that ``needs_context`` takes the whole shard: ``generic_whole``, or on such a CPU shard
    ``compiled_whole``. Before all of these, with ``mode.native``: ``native_update`` where
    ``native_fused`` allows it (``param_dtype``: the params'), then with ``mode.leafwise``
    ``compiled_leaves``."""
    if mode.native:
        g = grads.segments()
        fused = native_fused(tx, tx_state, g.parts, g.numel, skip, norm, param_dtype)
        if fused is not None:
            return native_update, fused
    if mode.leafwise:
        return compiled_leaves, None
    # eager on a large CPU shard, outside a dispatch mode (torch.compile does not run under one)
    compile_it = (mode.chunk is not None and not mode.compiled and numel >= COMPILE_NUMEL
                  and _get_current_dispatch_mode() is None)
    if tx.needs_context:  # the whole shard at once, never in chunks
        return (compiled_whole if compile_it else generic_whole), None
    if mode.fused:
        fused = tx.fused(tx_state, grad_scale=grads.grad_scale.to(mode.state_device), found_inf=skip, grad_norm=norm)
        if fused is not None and fused.kernel is not None:
            return fused_chunks, fused
    if mode.chunk is None or mode.chunk >= numel:
        return generic_whole, None
    if compile_it and _low_precision(tx_state, numel):
        return compiled_chunks, None
    return generic_chunks, None
