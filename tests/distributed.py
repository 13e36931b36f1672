"""Run a function on N spawned gloo ranks on CPU, with a timeout and per-test rendezvous.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, each joins a
gloo group through a ``file://`` rendezvous in a fresh temporary directory (so parallel tests
never collide; ``init=False`` leaves joining to ``fn`` via ``init_group``), calls ``fn(rank, world_size, *args)`` and returns the list of per-rank
results (anything ``torch.save`` can store with ``weights_only`` loading: tensors, lists,
dicts, numbers). A rank's exception is re-raised here with its traceback; a rank that does
not finish within ``timeout`` seconds fails the test instead of hanging it.

The processes are forked from a forkserver that imported torch and fzero once per test session
(``start="forkserver"``, the default): a fresh process per rank and per call, as with spawn,
without paying the imports each time (about 2 s of CPU per rank on a 2-core box, most of a small
test's time). Forked children leave by ``os._exit``, so ``atexit`` handlers do not run in them:
a test of exit-time behaviour passes ``start="spawn"``.
"""
from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fzero

_FORKSERVER = mp.get_context("forkserver")
# Imported once in the forkserver, which runs no tensor op: no thread pool starts there (a fork of
# a process with a running OpenMP pool may hang in the child). torch._dynamo.repro.after_dynamo is
# what the first torch.compile() imports (engine.init makes the compiled update's wrapper: some
# 0.2 s per rank process otherwise); helpers, what most rank functions use.
_FORKSERVER.set_forkserver_preload(["torch", "torch.distributed", "fzero", "fzero.transforms", "fzero.models",
                                    "torch._dynamo.repro.after_dynamo", "distributed", "helpers"])


def init_group(rank: int, world_size: int, timeout: float = 60.0) -> None:
    """Join this test's gloo group (called by the harness, or by ``fn`` when ``init=False``);
    ``timeout`` bounds the rendezvous and every collective of the group."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.environ['FZERO_TEST_RENDEZVOUS']}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    # Every rank connected before any goes on: gloo's init returns on a rank once its own side of
    # each connection is made, and a rank that then fails at once (a test of a peer's failure)
    # closed its sockets while its peer was still connecting, which failed the peer's init.
    dist.barrier()


def require_tier(tier: str, what: str) -> None:
    """Fail a test that ``what`` (starts ranks, runs the main job) without at least ``tier``'s
    marker (the tiers: tests/conftest.py); outside pytest nothing is checked."""
    order = ("unit", "multirank", "e2e")
    have = os.environ.get("FZERO_TEST_TIER")
    if have is not None and order.index(have) < order.index(tier):
        raise RuntimeError(f"this test {what}: mark it @pytest.mark.{tier} (tier {have!r} now; see tests/conftest.py)")


def _worker(rank, world_size, tmp, fn, args, init, may_die):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["FZERO_TEST_RENDEZVOUS"] = os.path.join(tmp, "rendezvous")
    torch.set_num_threads(1)
    out = os.path.join(tmp, f"rank{rank}")
    try:
        if init:
            init_group(rank, world_size)
        result = fn(rank, world_size, *args)
        fzero.shutdown(barrier=not may_die)  # a no-op if fn already shut down or never joined
        torch.save(result, out + ".pt")
    except BaseException:
        with open(out + ".err", "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1)


def _alone(fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    fn(*args)


def start_process(fn, *args):
    """``fn(*args)`` in a new process from the forkserver (no process group), started: its
    ``multiprocessing.Process``, for a test that kills it."""
    require_tier("multirank", "starts a process")
    proc = _FORKSERVER.Process(target=_alone, args=(fn, args))
    proc.start()
    return proc


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0, init: bool = True, may_die=(),
              start: str = "forkserver") -> list:
    """See the module docstring. Ranks in ``may_die`` may exit without a result (``None``);
    ``start``: the multiprocessing start method, ``"forkserver"`` or ``"spawn"``."""
    require_tier("multirank", "starts gloo ranks")
    ctx = _FORKSERVER if start == "forkserver" else mp.get_context(start)
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world_size, tmp, fn, args, init, tuple(may_die))) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        for r in range(world_size):
            err = os.path.join(tmp, f"rank{r}.err")
            if os.path.exists(err):
                errors.append(f"--- rank {r} ---\n" + open(err).read())
        if errors:
            raise RuntimeError("rank(s) failed:\n" + "\n".join(errors))
        if hung:
            raise TimeoutError(f"rank(s) {hung} still running after {timeout}s")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0 and r not in may_die]
        if bad:
            raise RuntimeError(f"rank(s) {bad} exited with codes {[procs[r].exitcode for r in bad]}")
        results = []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pt")
            results.append(torch.load(path, weights_only=True) if os.path.exists(path) or r not in may_die else None)
        return results
