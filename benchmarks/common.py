"""Timing helpers shared by the benchmarks: medians of repeated runs, CUDA events on GPU."""
from __future__ import annotations

import json
import mmap
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from fzero.models import gpt

# The GPT sizes the benchmarks run: the main job's configs at its data's vocabulary (97
# characters); gpt2 at GPT-2 small's shapes, its vocabulary padded.
GPT_CONFIGS = {
    "nano": lambda: gpt.GPTConfig(97, block_size=64, n_layer=2, n_head=4, n_embd=64),
    "tiny": lambda: gpt.GPTConfig.tiny(97),
    "small": lambda: gpt.GPTConfig.small(97),
    "gpt2": lambda: gpt.GPTConfig(50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample_times(fns, device: torch.device, *, iters: int, warmup: int, before=None):
    """Seconds of each of ``iters`` runs of ``fn()`` after ``warmup`` untimed ones: CUDA events
    on a GPU, the host clock elsewhere. ``fns``: one function (a list of seconds back) or a dict
    of them (a dict of lists back), run in turn within each iteration, so that drift in the
    machine's speed hits all alike. ``before()``, if given, runs untimed before each run, e.g.
    ``dist.barrier`` so that every rank starts together."""
    named = fns if isinstance(fns, dict) else {None: fns}
    times = {name: [] for name in named}
    sync(device)
    for i in range(warmup + iters):
        for name, fn in named.items():
            if before is not None:
                before()
            if i < warmup:
                fn()
                sync(device)
            elif device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times[name].append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return times if isinstance(fns, dict) else times[None]


def median_time(fn, device: torch.device, *, iters: int = 20, warmup: int = 3, before=None) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after ``warmup`` runs (see ``sample_times``)."""
    return statistics.median(sample_times(fn, device, iters=iters, warmup=warmup, before=before))


def fresh_mib(run) -> float:
    """MiB of memory that ``run()`` touched for the first time: minor page faults x page size
    (this process, host memory: on a CPU, the pages the kernel zeroed for it)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * resource.getpagesize() / 2**20


def fresh_pages(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``numel`` ``dtype`` elements on memory mapped for it now (an anonymous
    ``mmap``, private as glibc's are: Python's default, shared, is shared memory, whose pages
    fault in at about half the speed), whatever the allocator keeps: writing it faults in every
    page, which the kernel zeroes first, as a buffer above glibc's mmap threshold is when the
    allocator keeps nothing. The mapping goes with the tensor (``torch.frombuffer`` holds the only
    reference to it)."""
    return torch.frombuffer(mmap.mmap(-1, max(numel * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE), dtype=dtype,
                            count=numel)


def paired_ratio(a, b, device: torch.device, *, rounds: int, iters: int = 5) -> float:
    """Median over ``rounds`` of ``median_time(a) / median_time(b)``, the two alternated
    (``iters`` runs each per round), so that drift in the machine's speed hits both."""
    return statistics.median(median_time(a, device, iters=iters, warmup=1) / median_time(b, device, iters=iters, warmup=1)
                             for _ in range(rounds))


def leaf_by_leaf(engine) -> bool:
    """Whether ``engine`` (after ``init``) runs the compiled update from a grads pytree leaf by
    leaf (``fzero.cpu.leafwise``; ``fzero.plan.kernels`` decides at ``init``)."""
    return engine._kernels.leaves is not None


def hardware(device: torch.device) -> str:
    """The device the numbers come from: a GPU's name, or the CPU's model (Linux's
    ``/proc/cpuinfo``), the vector instructions torch's kernels use on it and the threads."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    isa = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
    return (f"{cpu_model()} ({platform.machine()}{', ' + isa if isa else ''}) x{torch.get_num_threads()} threads, "
            f"torch {torch.__version__}")


def cpu_model() -> str:
    """The CPU's model name as the OS reports it (``model name`` in ``/proc/cpuinfo``); where
    there is none, ``platform.processor()`` or the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names and names[0] else platform.processor() or platform.machine()


def write_json(path: str, data) -> None:
    """``data`` as JSON in the file ``path`` (one space per level), closed before it returns: a
    script's ``--json`` output, or a child process's results for its parent."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def table(rows: list[list], header: list[str]) -> str:
    cells = [[str(c) for c in r] for r in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells[1:]])


def classic_step(p16: list, g16: list, *, fused: bool):
    """The classic mixed-precision recipe as a step function: FP32 master copies of the FP16
    params ``p16``; each step casts the FP16 grads ``g16`` up, unscales them with amp's kernel
    (scale 2**16), runs ``torch.optim.AdamW`` (``fused``, else foreach) and copies back."""
    dev = p16[0].device
    master = [torch.nn.Parameter(p.float()) for p in p16]
    opt = torch.optim.AdamW(master, lr=1e-4, fused=fused, foreach=not fused)
    found_inf = torch.zeros(1, device=dev)
    inv_scale = torch.full((1,), 1 / 65536.0, device=dev)

    def step():
        for m, g in zip(master, g16):
            m.grad = g.float()
        torch._amp_foreach_non_finite_check_and_unscale_([m.grad for m in master], found_inf, inv_scale)
        opt.step()
        torch._foreach_copy_(p16, master)

    return step


def rows_of_ranks(script: str, argv: list[str], world: int, env: dict | None = None) -> list:
    """Run ``script argv --child-out FILE`` in processes of its own, under torchrun for 2+ ranks
    (one process for 1), one OMP thread per core and rank unless ``OMP_NUM_THREADS`` is set,
    with ``env`` added; what rank 0 wrote to FILE (JSON) comes back."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        launch = [] if world == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
        cmd = [sys.executable, *launch, os.path.abspath(script), *argv, "--child-out", out]
        threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": threads, **(env or {})})
        with open(out) as f:
            return json.load(f)


def profile_table(run, rows: int) -> str:
    """``torch.profiler``'s table of the ``rows`` ops with the most self CPU time in ``run()``
    (inductor's CPU kernels are named when ``torch._inductor.config.cpp.enable_kernel_profile``
    was set before they compiled). Where CUDA is available its kernels are profiled too (the
    table's CUDA columns), waited for before the profile ends."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
