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
for the machine it runs on (``-march=native``, the library named after the source, the flags, the
CPU's flags and torch's version), and cached in ``fzero_native/`` under ``TORCH_EXTENSIONS_DIR``
(torch's default when unset). One process at a time checks, builds and loads it, under an
``flock`` on the library's ``.lock`` file, which the kernel drops when that process ends however
it ends; the others wait for it at most ``FZERO_NATIVE_BUILD_TIMEOUT`` seconds (300). A build runs
in a directory of its own and the library is renamed into place whole, its size and sha256
recorded beside it (``.json``); a cached library is read and checked against that record before it
is loaded (loading a truncated one kills the process with SIGBUS), and rebuilt where it differs.
Where it cannot be built (no compiler), another process holds the lock past the timeout (warned,
with the lock file's name) or ``FZERO_NATIVE=0``, ``available()`` is ``False`` and the step runs
inductor's loops and torch's kernels instead.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import os
import platform
import shutil
import socket
import tempfile
import time
import warnings
from typing import NamedTuple, Optional

import torch

from fzero.transforms.fused import AdamWCoefficients

from ..memory import check_in_buffer

__all__ = ["available", "adamw_update", "sum_of_squares", "pack", "COEFFICIENTS"]

# The 0-d FP32 values ``adamw_update`` takes, in this order: the transform's AdamWCoefficients.
COEFFICIENTS = AdamWCoefficients._fields


def pack(coefficients: AdamWCoefficients) -> torch.Tensor:
    """The ``[8]`` FP32 tensor of ``coefficients`` that ``adamw_update`` reads (``COEFFICIENTS``)."""
    return torch.stack(list(coefficients))

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


# Seconds a process waits for another that holds the build's lock (FZERO_NATIVE_BUILD_TIMEOUT).
_BUILD_TIMEOUT = 300.0

_FALLBACK = "the step runs the compiled update instead"


class _Files(NamedTuple):
    """One build's files in ``<TORCH_EXTENSIONS_DIR>/fzero_native/``, each named ``name`` and a suffix."""
    name: str     # fzero_native_ and a hash of the source, the flags, torch's version and the CPU's flags
    lock: str     # flock-ed by the one process that checks, builds and loads the library
    library: str  # renamed into place whole once built
    record: str   # the library's {"size": bytes, "sha256": hex digest}, written after it


def _files() -> _Files:
    """The files of this source's build for this machine and torch."""
    from torch.utils.cpp_extension import get_default_build_root

    with open(_SOURCE) as f:
        source = f.read()
    key = hashlib.sha1("\n".join([source, " ".join(_FLAGS), torch.__version__, _cpu_flags()]).encode()).hexdigest()
    name = f"fzero_native_{key[:16]}"
    base = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(), "fzero_native", name)
    return _Files(name, base + ".lock", base + ".so", base + ".json")


def _build_timeout() -> float:
    """``FZERO_NATIVE_BUILD_TIMEOUT`` (seconds, ``>= 0``; ``inf`` waits for good), else 300."""
    text = os.environ.get("FZERO_NATIVE_BUILD_TIMEOUT")
    if text is None:
        return _BUILD_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:
        raise ValueError(f"FZERO_NATIVE_BUILD_TIMEOUT={text!r}: give the seconds a process waits for another's "
                         f"build of fzero's CPU kernels, a number >= 0 (unset: {_BUILD_TIMEOUT:g})")
    return seconds


class _Busy(Exception):
    """Another process held the build's lock past the timeout."""


@contextlib.contextmanager
def _locked(path: str, timeout: float):
    """An exclusive ``flock`` on ``path`` (created), held in the block; the process that holds it
    writes its pid and host there. Waits at most ``timeout`` seconds for the process holding it,
    then raises ``_Busy``. The kernel drops the lock when the file is closed or its process ends,
    however it ends (SIGTERM, SIGKILL): a killed build leaves no lock behind."""
    import fcntl  # POSIX: elsewhere the ImportError is the reason the kernels are not built

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # held: flock has no timeout of its own, so poll it (as torch's FileBaton does)
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 256, 0).decode(errors="replace").split()
                    who = f"process {holder[0]} on {holder[1]}" if len(holder) == 2 else "another process"
                    raise _Busy(f"waited {timeout:g} s for {path}, locked by {who}, which builds or loads the CPU "
                                f"kernels; {_FALLBACK} (the lock is gone when that process ends: let it finish or end "
                                "it; FZERO_NATIVE_BUILD_TIMEOUT=<seconds> waits longer, FZERO_NATIVE=0 skips the "
                                "kernels)") from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        yield
    finally:
        os.close(fd)


def _digest(path: str) -> dict:
    """``{"size": bytes, "sha256": hex digest}`` of the file at ``path``, read (never mapped)."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": sha.hexdigest()}


def _whole(files: _Files) -> bool:
    """Whether the cached library is there and is the one its record describes (a damaged one:
    warned of, for a rebuild). Checked by reading it, before any load: loading a truncated
    library faults on the pages past its end (SIGBUS), where no exception can be caught."""
    if not os.path.exists(files.library):
        return False
    got = _digest(files.library)
    try:
        with open(files.record) as f:
            want = json.load(f)
    except (OSError, ValueError):  # none, or cut short: a build killed between the two renames
        want = None
    if got == want:
        return True
    why = ("no record of it" if not isinstance(want, dict) else
           f"{got['size']} bytes where {want.get('size')} were built" if got["size"] != want.get("size") else
           "its sha256 differs from the built one's")
    warnings.warn(f"fzero.cpu.native: the cached CPU kernels {files.library} are damaged ({why}); rebuilding them",
                  RuntimeWarning, stacklevel=4)
    return False


def _build(files: _Files) -> None:
    """Builds and loads the library in a new directory beside the cache, then renames it into
    place and writes its record. Called with the lock held: the directories of earlier builds
    are those of killed processes (a truncated library that ninja would take for up to date,
    torch's ``lock`` file that would hold ``cpp_extension.load`` forever), removed first."""
    from torch.utils.cpp_extension import load

    prefix = files.library[:-len(".so")] + ".build-"
    for killed in glob.glob(glob.escape(prefix) + "*"):
        shutil.rmtree(killed, ignore_errors=True)
    stage = tempfile.mkdtemp(prefix=os.path.basename(prefix), dir=os.path.dirname(prefix))
    try:
        load(files.name, sources=[_SOURCE], extra_cflags=_FLAGS, build_directory=stage, is_python_module=False,
             verbose=False)
        built, = glob.glob(os.path.join(glob.escape(stage), "*.so"))  # name_v1.so where this process built it before
        record = os.path.join(stage, "record")
        with open(record, "w") as f:
            json.dump(_digest(built), f)
        os.replace(built, files.library)  # the inode torch loaded: the cached library is the loaded one
        os.replace(record, files.record)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@functools.cache
def _module():
    """The built kernels' ops (``torch.ops.fzero_native``), or ``None`` where they cannot be
    built or loaded, or another process builds them past the timeout (warned once)."""
    if os.environ.get("FZERO_NATIVE", "1") == "0":
        return None
    timeout = _build_timeout()
    try:  # a library of ops, not a Python module: loaded by torch.ops.load_library
        files = _files()
        os.makedirs(os.path.dirname(files.lock), exist_ok=True)
        with _locked(files.lock, timeout):
            if _whole(files):
                torch.ops.load_library(files.library)
            else:
                _build(files)
    except _Busy as e:
        warnings.warn(f"fzero.cpu.native: {e}", RuntimeWarning, stacklevel=3)
        return None
    except Exception as e:  # no compiler, one that rejects the flags, no source, an unwritable cache
        warnings.warn(f"fzero.cpu.native: the CPU kernels could not be built or loaded ({type(e).__name__}: {e}); "
                      f"{_FALLBACK}", RuntimeWarning, stacklevel=3)
        return None
    return torch.ops.fzero_native


def available(device: torch.device) -> bool:
    """Whether the kernel runs for state on ``device``: a CPU, the extension built (at the first
    call, a compiler's run: once per machine and torch version)."""
    return device.type == "cpu" and _module() is not None


def adamw_update(grads: list[torch.Tensor], starts: list[int], coefficients: torch.Tensor, mean_factor: torch.Tensor,
                 skip: torch.Tensor, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 params: torch.Tensor | None, *, cast_on_skip: bool = False) -> None:
    """The update of an ``[S]`` shard in place: ``grads[i]`` (1-D FP16, BF16 or FP32,
    contiguous) holds the elements from ``starts[i]`` (pieces in any order, not overlapping; the
    elements no piece holds have zero grads, the padding); ``coefficients``: the transform's for this
    step, packed (``pack``: ``[8]`` FP32); ``master``, ``m``, ``v`` ``[S]`` FP32, written; ``params`` ``[S]`` FP16,
    BF16 or FP32, written with the new master's cast (FP32: its value), or ``None`` where the
    FP32 params are the master itself (``master="params"``). A skipped step writes nothing (the
    params are the old master's cast already), or with ``cast_on_skip`` (new params: the pure
    step) only the params, the master's cast."""
    _module().adamw_update(grads, starts, coefficients, mean_factor, skip, master, m, v, params, cast_on_skip)


@torch.library.custom_op("fzero::adamw_update_", mutates_args=("master", "m", "v", "params"))
def _adamw_update_op(grads: list[torch.Tensor], starts: list[int], coefficients: torch.Tensor,
                     mean_factor: torch.Tensor, skip: torch.Tensor, master: torch.Tensor, m: torch.Tensor,
                     v: torch.Tensor, params: Optional[torch.Tensor], cast_on_skip: bool) -> None:
    """``adamw_update`` as an op a traced step keeps whole (``fzero.cpu.kernel.native_update``;
    ``params`` and, where the params are the master, ``master`` 1-D, or ``[S, 1]`` compiled from
    a grads pytree, ``fzero.cast.IntoLeaves``)."""
    adamw_update(grads, starts, coefficients, mean_factor, skip, master.view(-1), m, v,
                 None if params is None else params.view(-1), cast_on_skip=cast_on_skip)


@_adamw_update_op.register_fake
def _(grads, starts, coefficients, mean_factor, skip, master, m, v, params, cast_on_skip):
    return None


@torch.library.custom_op("fzero::views_checked", mutates_args=())
def views_checked(buffer: torch.Tensor, leaves: list[torch.Tensor], offsets: list[int]) -> torch.Tensor:
    """A 0-d ``False`` once ``leaves`` are checked to be views of ``buffer`` (``[S, 1]``,
    ``fzero.cast.IntoLeaves``) at ``offsets`` (``fzero.memory.check_in_buffer``, which raises). A
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
