"""``warm_start``: what a program calls once, before its first compiled call, so that a process
whose compiled functions torch has compiled before starts its first step sooner.

Two costs of every new process that torch's own caches (inductor's FX graph cache, the
AOTAutograd cache) leave in place, each removed here (measured in docs/startup.md):

* **AOTAutograd's cache skips fzero's grads buffer.** A loss differentiated into a kept grads
  buffer (``fzero.unflatten(..., grads_into=...)``, the main job's compiled loss) holds fzero's
  ``autograd.Function``, and AOTAutograd's cache passes over any graph with one (its backward
  could run arbitrary Python): every process traces the joint graph and partitions it again.
  fzero's backward is one registered op (``fzero::cat_into``), safe to cache, and
  ``warm_start`` turns on torch's ``autograd_cache_allow_custom_autograd_functions`` -- for
  every ``autograd.Function`` in the process, so a program whose own Functions have side
  effects in backward should not call it.
* **Inductor probes the CPU's vector instructions in subprocesses** (one Python child per
  candidate ISA, to ``dlopen`` a test library) in every process that compiles a CPU kernel.
  ``warm_start`` keeps the probe's verdict in fzero's cache directory, keyed by the torch
  version, the Python and the CPU's flags, and on a later start with the same key, when the
  probe passed every candidate, tells inductor so (``cpp.vec_isa_ok``) instead of probing.

fzero's cache directory: ``$FZERO_CACHE_DIR``, else ``$XDG_CACHE_HOME/fzero``, else
``~/.cache/fzero`` (what inductor keeps stays where inductor keeps it: ``TORCHINDUCTOR_CACHE_DIR``,
by default ``/tmp/torchinductor_$USER``). Nothing here runs inside a step.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys

import torch
import torch._inductor.config

__all__ = ["cache_dir", "warm_start"]


def cache_dir() -> str:
    """fzero's cache directory (see the module docstring); not created here."""
    if os.environ.get("FZERO_CACHE_DIR"):
        return os.environ["FZERO_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fzero")


def warm_start(*, directory: str | None = None) -> dict:
    """Turn on what the module docstring lists, once per process, before the first compiled
    call. ``directory``: fzero's cache directory (default ``cache_dir()``). Returns what it did:
    ``{"autograd_cache": bool, "vec_isa": "probed" | "remembered" | "mixed" | "none"}`` --
    ``"mixed"``: the probe rejected an ISA that the CPU's flags list, so inductor keeps probing.
    Where this torch lacks a knob (older versions), that part is left as torch has it."""
    import torch._functorch.config as functorch_config

    autograd = hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions")
    if autograd:
        functorch_config.autograd_cache_allow_custom_autograd_functions = True
    return {"autograd_cache": autograd, "vec_isa": _remember_vec_isa(directory or cache_dir())}


def _cpu_key() -> str:
    """What the vector-ISA probe's verdict depends on: torch, the Python, the CPU's flags,
    and the settings that pick an ISA."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    parts = [torch.__version__, sys.executable, platform.machine(), flags, os.environ.get("ATEN_CPU_CAPABILITY", ""),
             str(torch._inductor.config.cpp.simdlen)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _remember_vec_isa(directory: str) -> str:
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:  # an older torch: its probe stays as it is
        return "none"
    if torch._inductor.config.cpp.vec_isa_ok is not None:  # the user decided already
        return "none"
    path = os.path.join(directory, "vec_isa", _cpu_key() + ".json")
    try:
        with open(path) as f:
            verdict = json.load(f)
    except (OSError, ValueError):
        verdict = None
    if isinstance(verdict, dict) and verdict.get("all_pass") is True:
        torch._inductor.config.cpp.vec_isa_ok = True
        return "remembered"
    if verdict is not None:
        return "mixed"
    probed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]  # torch's probe, in this process
    with torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
        listed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list.__wrapped__()]  # by the CPU's flags alone
    all_pass = probed == listed
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"all_pass": all_pass, "probed": probed, "listed": listed, "torch": torch.__version__}, f)
        os.replace(tmp, path)  # whole or absent: a concurrent start reads one verdict or none
    except OSError:  # a read-only home: probe again next time
        pass
    if not all_pass:
        return "mixed"
    # Set in this process too: inductor's graph cache keys hold its config, so the process that
    # probed and the ones that remember compile under one key.
    torch._inductor.config.cpp.vec_isa_ok = True
    return "probed"
