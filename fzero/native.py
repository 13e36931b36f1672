"""fzero's own CPU kernels: the mixed-precision AdamW update (``adamw_update``), one pass per
element that reads the FP16, BF16 or FP32 grad, updates the FP32 master and both FP32 moments and
writes the param in its dtype (DeepSpeed's ``DeepSpeedCPUAdam`` is such a kernel, for
ZeRO-Offload's CPU step; FP32 params may be the master itself, then nothing else is written); and
the norm's sum of squares (``sum_of_squares``), which reads the grads once where torch's ops
would first copy them into FP32 or float64.

Per element, with ``g`` the grad in FP32 times the 0-d ``mean_factor`` (``ShardGrads.mean``),
and the 0-d FP32 coefficients ``transforms.adam``'s arithmetic computes once per step::

    m' = m + w1 (g - m)                      w1 = 1 - b1
    v' = v b2 + (w2 g) g                     w2 = 1 - b2
    u  = (m' step_size) / (sqrt(v') inv_bc2 + eps)
    w' = w + neg_lr (u + wd w)               neg_lr = -lr
    p  = cast(clamp(w', -max, max))          FP16: to nearest, ties to even; BF16: ties away;
                                             FP32: w' itself

each product and sum rounded on its own (no FMA contraction, ``-ffp-contract=off``), in the
order above: the same bits as the update inductor compiles from ``transforms.adamw``
(``tests/test_native.py``). In place; a skipped step (``skip``, read once per call) writes
nothing, or into new params (the pure step) only their cast of the master.

Why a kernel of its own: the CPU code inductor generates for the same arithmetic has no vector
form of reading FP32 bits as int32, so BF16's ties-away rounding is a dozen FP32 operations there
and the cast to BF16 another seven (``fzero.remainder``); a skip is three selects per element
where this kernel branches once per call.

The kernels are ``native.cpp`` beside this file: ops registered with torch
(``torch.ops.fzero_native``), no Python binding, so the build reads torch's op-registration and
tensor headers, not all of ``torch/extension.h``. Compiled by ``torch.utils.cpp_extension`` at the
first ``available()`` (an engine's ``init`` at world size 1, or the first eager norm of CPU grads)
for the machine it runs on (``-march=native``, the extension named after the CPU's flags and
torch's version), cached as torch caches extensions (``TORCH_EXTENSIONS_DIR``). Where it cannot be
built (no compiler) or ``FZERO_NATIVE=0``, ``available()`` is ``False`` and the step runs
inductor's loops and torch's kernels instead.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from typing import Optional

import torch

from .flat import check_in_buffer

__all__ = ["available", "adamw_update", "sum_of_squares", "COEFFICIENTS"]

# The 0-d FP32 values ``adamw_update`` takes, in this order (``transforms.adam.AdamWCoefficients``).
COEFFICIENTS = ("w1", "b2", "w2", "eps", "step_size", "inv_bc2", "neg_lr", "wd")

# The kernels, in C++: a file of the package beside this one.
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native.cpp")

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]


def _cpu_flags() -> str:
    """The CPU's model and instruction-set flags (Linux), else the platform: a build for one
    machine's ``-march=native`` is never loaded on another from a shared cache."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("flags", "model name", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


@functools.cache
def _module():
    """The built kernels' ops (``torch.ops.fzero_native``), or ``None`` where they cannot be
    built (warned once)."""
    if os.environ.get("FZERO_NATIVE", "1") == "0":
        return None
    from torch.utils.cpp_extension import load

    try:  # a library of ops, not a Python module: loaded by torch.ops.load_library
        with open(_SOURCE) as f:
            source = f.read()
        key = hashlib.sha1("\n".join([source, " ".join(_FLAGS), torch.__version__, _cpu_flags()]).encode()).hexdigest()
        load(f"fzero_native_{key[:16]}", sources=[_SOURCE], extra_cflags=_FLAGS, is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, one that rejects the flags, no source
        warnings.warn(f"fzero.native: the CPU AdamW kernel could not be built ({type(e).__name__}: {e}); "
                      "the step runs the compiled update instead", RuntimeWarning, stacklevel=3)
        return None
    return torch.ops.fzero_native


def available(device: torch.device) -> bool:
    """Whether the kernel runs for state on ``device``: a CPU, the extension built (at the first
    call: some 10 s on a 2-core CPU, once per machine and torch version)."""
    return device.type == "cpu" and _module() is not None


def adamw_update(grads: list[torch.Tensor], starts: list[int], coefficients: torch.Tensor, mean_factor: torch.Tensor,
                 skip: torch.Tensor, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 params: torch.Tensor | None, *, cast_on_skip: bool = False) -> None:
    """The update of an ``[S]`` shard in place: ``grads[i]`` (1-D FP16, BF16 or FP32,
    contiguous) holds the elements from ``starts[i]`` (pieces in any order, not overlapping; the
    elements no piece holds have zero grads, the padding); ``coefficients`` ``[8]`` FP32
    (``COEFFICIENTS``); ``master``, ``m``, ``v`` ``[S]`` FP32, written; ``params`` ``[S]`` FP16,
    BF16 or FP32, written with the new master's cast (FP32: its value), or ``None`` where the
    FP32 params are the master itself (``master="params"``). A skipped step writes nothing (the
    params are the old master's cast already), or with ``cast_on_skip`` (new params: the pure
    step) only the params, the master's cast."""
    _module().adamw_update(grads, starts, coefficients, mean_factor, skip, master, m, v, params, cast_on_skip)


@torch.library.custom_op("fzero::adamw_update_", mutates_args=("master", "m", "v", "params"))
def _adamw_update_op(grads: list[torch.Tensor], starts: list[int], coefficients: torch.Tensor,
                     mean_factor: torch.Tensor, skip: torch.Tensor, master: torch.Tensor, m: torch.Tensor,
                     v: torch.Tensor, params: Optional[torch.Tensor], cast_on_skip: bool) -> None:
    """``adamw_update`` as an op a traced step keeps whole (``fzero.update.native_update``;
    ``params`` and, where the params are the master, ``master`` 1-D, or ``[S, 1]`` compiled from
    a grads pytree, ``stages.cast_target``)."""
    adamw_update(grads, starts, coefficients, mean_factor, skip, master.view(-1), m, v,
                 None if params is None else params.view(-1), cast_on_skip=cast_on_skip)


@_adamw_update_op.register_fake
def _(grads, starts, coefficients, mean_factor, skip, master, m, v, params, cast_on_skip):
    return None


@torch.library.custom_op("fzero::views_checked", mutates_args=())
def views_checked(buffer: torch.Tensor, leaves: list[torch.Tensor], offsets: list[int]) -> torch.Tensor:
    """A 0-d ``False`` once ``leaves`` are checked to be views of ``buffer`` (``[S, 1]``,
    ``stages.cast_target``) at ``offsets`` (``fzero.flat.check_in_buffer``, which raises). A
    traced step ORs it into its skip flag, so that everything the step writes (the kernel's
    update, the state's new counts) depends on it and runs after the check."""
    check_in_buffer(buffer.view(-1), leaves, offsets)
    return torch.zeros((), dtype=torch.bool, device=buffer.device)


@views_checked.register_fake
def _(buffer, leaves, offsets):
    return torch.empty((), dtype=torch.bool, device=buffer.device)


def sum_of_squares(pieces: list[torch.Tensor], row: int, *, wide: bool) -> torch.Tensor:
    """``sum(g**2)`` over ``pieces`` (1-D FP16, BF16 or FP32, contiguous) as a 0-d float64, in
    rows of ``row`` elements: each piece's full rows in order, then the elements after them
    (every piece's, end to end) zero-padded to full rows. Each row's sum is taken in float64
    (``wide``) or FP32, in 16 (8) running sums added pairwise, and the rows' sums are added in
    float64 in that order: the same bits for the same pieces. Non-finite iff an element is
    inf or NaN, or (FP32) a row's sum overflows."""
    return torch.ops.fzero.sum_of_squares(pieces, row, wide)


@torch.library.custom_op("fzero::sum_of_squares", mutates_args=())
def _sum_of_squares_op(pieces: list[torch.Tensor], row: int, wide: bool) -> torch.Tensor:
    """``sum_of_squares`` as an op (a ``TorchDispatchMode``, ``benchmarks/traffic.py``, sees the
    pieces it reads)."""
    return _module().sum_of_squares(pieces, row, wide)


@_sum_of_squares_op.register_fake
def _(pieces, row, wide):
    return torch.empty((), dtype=torch.float64, device=pieces[0].device if pieces else "cpu")
