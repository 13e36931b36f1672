"""Checkpoints that do not stop training: ``save`` against ``async_save``, side by side in one run.

Two states, each trained by its own step:

* ``main``: the main job's model and step -- GPT nano, FP16 params, dynamic loss scale, AdamW,
  ``donate=True``, ``examples/recipe.py``'s compiled ``make_train_step`` -- at ``--ranks`` ranks
  (2, as ``make train``: gloo, one thread per rank), random tokens;
* ``--numel`` (1e8): one process, one FP16 leaf of that many elements, AdamW, the eager
  ``engine.step`` on fixed grads: the optimizer step is the whole training step.

For each, ``--rounds`` rounds of: ``--steps`` steps with no save in flight, each timed; one
``save`` (the time training is blocked: all of it); one ``async_save`` (blocked: until it
returns), then steps while its write runs (every rank steps until every rank's write is
committed), each timed, and the write's time (from the return to the commit). Reported: the
medians of the blocked times and their ratio (goal: ``async_save`` blocks at most 10% of what
``save`` does); the step time during the write over the step time without, per round, then the
median over the rounds (goal: at most 1.15x on a 2-core box); the first ``async_save``'s blocked
time (it allocates the staging buffer) apart.

``--writers`` (the ``--numel`` state, one process) also compares the two ways to run the write
off the training thread, on the same staged bytes: the shard file written (``shard_file.write``:
``os.write``, ``fsync``, sha256) by a thread of this process, as ``async_save`` does, or by a
writer process of its own (spawned once; the staging buffer in shared memory), the file and
nothing else in either; steps during it against steps without, as above.

    python benchmarks/checkpoint.py                          # main at 2 ranks, 1e8 elements, thread vs process
    python benchmarks/checkpoint.py --quick                  # a tiny rehearsal
    python benchmarks/checkpoint.py --device cuda --numel 1e9 --states big   # the GPU suite's row
"""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import fzero  # noqa: E402
from fzero import transforms  # noqa: E402
from fzero.checkpoint import background, manifest, shard_file, staging  # noqa: E402
from fzero.models import gpt  # noqa: E402
from common import GPT_CONFIGS, hardware, rows_of_ranks, sync, table, write_json  # noqa: E402
from recipe import make_train_step  # noqa: E402


class Trainer:
    """A state and its step: ``step()`` advances ``carry`` = ``[params, state, scaler_state]``."""

    def __init__(self, engine, carry, step_fn):
        self.engine, self.carry, self._step = engine, list(carry), step_fn

    def step(self) -> None:
        self.carry[:] = self._step(*self.carry)


def main_job(dev, world: int, rank: int, batch: int, compile: bool) -> Trainer:
    cfg = GPT_CONFIGS["nano"]()
    engine = fzero.zero1(transforms.adamw(lr=3e-4, weight_decay=0.1), param_dtype=torch.float16,
                         loss_scale=fzero.DynamicLossScale(), donate=True)
    carry = engine.init(gpt.init(torch.Generator().manual_seed(0), cfg, device=dev))
    train_step = make_train_step(engine, functools.partial(gpt.loss, config=cfg), compile=compile)
    g = torch.Generator().manual_seed(rank)
    tokens = tuple(torch.randint(0, cfg.vocab_size, (batch // world, cfg.block_size), generator=g).to(dev)
                   for _ in range(2))
    return Trainer(engine, carry, lambda p, s, ss: train_step(p, s, ss, tokens)[:3])


def big_state(dev, numel: int) -> Trainer:
    engine = fzero.zero1(transforms.adamw(lr=1e-4, weight_decay=0.1), param_dtype=torch.float16,
                         loss_scale=fzero.DynamicLossScale(), donate=True)
    carry = engine.init({"w": torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(dev)})
    grads = {"w": (torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-3).to(dev, torch.float16)}
    return Trainer(engine, carry, lambda p, s, ss: engine.step(p, grads, s, ss)[:3])


def everyone(flag: bool, world: int) -> bool:
    """``flag`` on every rank (a tiny all-reduce outside the timed steps)."""
    if world == 1:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def timed(fn, dev) -> float:
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


def steps_while(done, trainer: Trainer, dev, world: int) -> list[float]:
    """Each step's seconds, stepping until ``done()`` is true on every rank (at least one step)."""
    times = []
    while True:
        times.append(timed(trainer.step, dev))
        if everyone(done(), world):
            return times


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def measure_saves(trainer: Trainer, dev, world: int, rank: int, rounds: int, steps: int, tmp: str, nice: int) -> dict:
    """The save rows of one state, the writer at ``nice`` (module doc)."""
    e = trainer.engine
    ck = fzero.checkpoint
    ck_async = functools.partial(ck.async_save, writer_nice=nice)
    for _ in range(2):  # compiled: the first steps compile
        trainer.step()
    barrier(world)
    t0 = time.perf_counter()  # the engine's first async_save: it allocates the staging buffer
    future = ck_async(os.path.join(tmp, "first"), *trainer.carry, e)
    first_blocked = time.perf_counter() - t0
    future.result()
    barrier(world)
    if rank == 0:
        shutil.rmtree(os.path.join(tmp, "first"), ignore_errors=True)
    sync_blocked, async_blocked, writes, ratios, during_n, base_ms, during_ms = [], [], [], [], [], [], []
    for r in range(rounds):
        barrier(world)
        base = [timed(trainer.step, dev) for _ in range(steps)]
        barrier(world)
        sync_blocked.append(timed(lambda: ck.save(os.path.join(tmp, "sync"), *trainer.carry, e), dev))
        barrier(world)
        t0 = time.perf_counter()
        future = ck_async(os.path.join(tmp, "async"), *trainer.carry, e)
        returned = time.perf_counter()
        done_at = []
        future.add_done_callback(lambda _: done_at.append(time.perf_counter()))
        during = steps_while(future.done, trainer, dev, world)
        future.result()
        async_blocked.append(returned - t0)
        writes.append(done_at[0] - returned)
        ratios.append(statistics.mean(during) / statistics.median(base))
        during_n.append(len(during))
        base_ms.append(statistics.median(base) * 1e3)
        during_ms.append(statistics.mean(during) * 1e3)
        barrier(world)
        if rank == 0:  # a round's checkpoints go: 1e9 elements are 12 GB each
            for name in ("sync", "async"):
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    med = statistics.median
    return {
        "writer_nice": nice, "threads": torch.get_num_threads(),
        "state_mib": e.state_bytes(trainer.carry[1]) / 2**20,
        "staging_mib": fzero.checkpoint.background.writer_of(e).buffer.nbytes / 2**20,
        "save_blocked_s": med(sync_blocked), "async_blocked_s": med(async_blocked),
        "blocked_ratio": med(a / s for a, s in zip(async_blocked, sync_blocked)),
        "first_async_blocked_s": first_blocked, "write_s": med(writes),
        "step_ms": med(base_ms), "step_during_write_ms": med(during_ms), "steps_during_write": med(during_n),
        "step_ratio": med(ratios),
    }


def _process_writer(conn, buffer, nice: int) -> None:
    """The writer process: writes ``buffer``'s first ``n`` bytes after a header, on request."""
    torch.set_num_threads(1)
    os.nice(nice)
    while (job := conn.recv()) is not None:
        file, head, n = job
        conn.send(shard_file.write(file, head, [buffer[:n]]))


def measure_writers(trainer: Trainer, dev, rounds: int, steps: int, tmp: str, nice: int) -> dict:
    """Steps while the staged shard file is written by a thread or by a process (module doc)."""
    e = trainer.engine
    names, leaves, _, kinds = manifest.state_leaves(trainer.carry[1], e.layout.shard_numel)
    buf = staging.StagingBuffer()
    contents = staging.staged(names, leaves, kinds, trainer.carry[2], e.layout.owned(0), True, buf)
    contents.ready()
    nbytes = sum(x.nbytes for x in contents.entries)
    buf.buffer.share_memory_()
    head = shard_file.header(contents.entries, {"format": "benchmark"})
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_process_writer, args=(child, buf.buffer, nice), daemon=True)
    proc.start()
    out = {}
    try:
        conn.send((os.path.join(tmp, "warm.safetensors"), head, nbytes))  # the child's start-up, untimed
        conn.recv()
        os.remove(os.path.join(tmp, "warm.safetensors"))
        def by_thread(file):
            result = []
            def write():
                background.lower_priority(nice)
                result.append(shard_file.write(file, head, [buf.buffer[:nbytes]]))

            t = threading.Thread(target=write)
            t.start()
            return lambda: not t.is_alive()

        def by_process(file):
            conn.send((file, head, nbytes))
            return conn.poll

        for name, start in (("thread", by_thread), ("process", by_process)):
            ratios, writes = [], []
            for r in range(rounds):
                base = [timed(trainer.step, dev) for _ in range(steps)]
                file = os.path.join(tmp, f"{name}-{r}.safetensors")
                t0 = time.perf_counter()
                done = start(file)
                during = steps_while(done, trainer, dev, 1)
                writes.append(time.perf_counter() - t0)
                if name == "process":
                    conn.recv()
                os.remove(file)
                ratios.append(statistics.mean(during) / statistics.median(base))
            out[f"{name}_step_ratio"] = statistics.median(ratios)
            out[f"{name}_write_s"] = statistics.median(writes)
    finally:
        conn.send(None)
        proc.join(30)
    return out


def run(args, dev, world: int, rank: int) -> list[dict]:
    rows = []
    tmp = tempfile.mkdtemp(dir=args.dir) if rank == 0 else None
    if world > 1:
        shared = [tmp]
        dist.broadcast_object_list(shared, 0)
        tmp = shared[0]
    try:
        for state in args.states:
            if state == "main":
                trainer = main_job(dev, world, rank, args.batch, not args.no_compile)
                what = f"main job (GPT nano, FP16), {world} rank(s)"
            elif world == 1:
                trainer = big_state(dev, int(args.numel))
                what = f"{int(args.numel):.0e} elements, 1 process"
            else:
                continue
            for nice in args.nice:
                row = {"state": what, **measure_saves(trainer, dev, world, rank, args.rounds, args.steps, tmp, nice)}
                if state == "big" and args.writers and world == 1:
                    row.update(measure_writers(trainer, dev, args.rounds, args.steps, tmp, nice))
                rows.append(row)
                fzero.checkpoint.background.writer_of(trainer.engine).buffer.buffer = None  # the next row's first save
            del trainer
    finally:
        barrier(world)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--states", nargs="+", choices=("main", "big"), default=["main", "big"])
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the main job's state: %(default)s")
    ap.add_argument("--numel", type=float, default=1e8, help="elements of the big state: %(default)s")
    ap.add_argument("--batch", type=int, default=16, help="the main job's global batch: %(default)s")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per state: %(default)s")
    ap.add_argument("--steps", type=int, default=5, help="steps without a save per round: %(default)s")
    ap.add_argument("--nice", nargs="+", type=int, default=[19, 0],
                    help="the writer thread's nice values (async_save(writer_nice=)), a row each: %(default)s")
    ap.add_argument("--no-writers", dest="writers", action="store_false", help="skip the thread-against-process rows")
    ap.add_argument("--no-compile", action="store_true", help="the main job's step eager")
    ap.add_argument("--dir", help="where the checkpoints go (default: the system's temporary directory)")
    ap.add_argument("--quick", action="store_true", help="a tiny rehearsal: 1e5 elements, 2 rounds of 2 steps")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.numel, args.rounds, args.steps = 1e5, 2, 2
    if args.child_out:  # rows_of_ranks' process: a rank under torchrun, or the one process
        ranked = "LOCAL_RANK" in os.environ
        dev = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
        if ranked:
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        world, rank = (dist.get_world_size(), dist.get_rank()) if ranked else (1, 0)
        rows = run(args, dev, world, rank)
        if rank == 0:
            rows = [{**r, "hardware": hardware(dev)} for r in rows]
            write_json(args.child_out, rows)
        fzero.shutdown()
        return
    rows = []
    if "main" in args.states:
        rows += rows_of_ranks(__file__, [*(argv or sys.argv[1:]), "--states", "main"], args.ranks)
    if "big" in args.states:
        rows += rows_of_ranks(__file__, [*(argv or sys.argv[1:]), "--states", "big"], 1)
    print(f"{os.cpu_count()} cores; {rows[0]['hardware'] if rows else ''}; the writer: one thread per rank")
    print(table([[r["state"], r["threads"], r["writer_nice"], f"{r['state_mib']:.1f}", f"{r['staging_mib']:.1f}", f"{r['save_blocked_s'] * 1e3:.1f}",
                  f"{r['async_blocked_s'] * 1e3:.1f}", f"{r['blocked_ratio']:.3f}", f"{r['first_async_blocked_s'] * 1e3:.1f}",
                  f"{r['write_s']:.2f}", f"{r['step_ms']:.1f}", f"{r['step_during_write_ms']:.1f}",
                  f"{r['steps_during_write']:g}", f"{r['step_ratio']:.3f}"] for r in rows],
                ["state", "training threads/rank", "writer nice", "state MiB/rank", "staging MiB", "save blocks ms", "async_save blocks ms", "async/save",
                 "first async ms", "write s", "step ms", "step ms during write", "steps during write",
                 "step during/without"]))
    writers = [r for r in rows if "thread_step_ratio" in r]
    for r in writers:
        print(f"\nshard file written off the training thread, {r['state']}, writer nice {r['writer_nice']}: step during/without "
              f"thread {r['thread_step_ratio']:.3f} (write {r['thread_write_s']:.2f} s), "
              f"process {r['process_step_ratio']:.3f} (write {r['process_write_s']:.2f} s)")
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
