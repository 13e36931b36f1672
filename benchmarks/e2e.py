"""The main job's training step beside the torch recipe a user would write instead, in one run.

torch: the same GPT as an ``nn.Module`` (``ModuleGPT``: same shapes, tied embedding, pre-LN,
tanh GELU), ``torch.compile``d, ``torch.autocast`` to FP16/BF16 (none for FP32) with
``torch.amp.GradScaler`` for FP16, ``torch.optim.AdamW(fused=True)``; under torchrun wrapped in
DDP. fzero: ``models.gpt`` through ``examples/recipe.py``'s ``make_train_step`` -- the main job's
step: with one bucket, the compiled loss of the flat param buffer and the compiled
``engine.step`` -- params in FP16/BF16/FP32, dynamic loss scaling for FP16; ``--variants`` adds
other fzero recipes (``VARIANTS``) to the same run. All take AdamW with lr 3e-4, weight decay
0.1 on every param, no clipping; random tokens (throughput only).

The recipes alternate in blocks of ``--steps`` steps after a warm-up that compiles them all;
tokens/s is the median over ``--rounds`` blocks; fzero / torch is the median over the rounds of
the ratio within each round (the blocks ran back to back). Rows for 1 rank, then 2 ranks (gloo
on CPU, NCCL on GPUs), which the script runs under torchrun itself. Last line: ``fzero/torch
tokens/s: <ratio>`` for the first row (1 rank, the first ``--dtype``, the first variant).

On a CPU each row also gives every recipe's fresh MiB per step: the memory its step touched for
the first time (minor page faults times the page size, rank 0), which the kernel must zero
before the step can write it. glibc's malloc hands every allocation above its mmap threshold
(at most 32 MiB) back to the kernel when it is freed, so a buffer of that size allocated every
step is fresh pages every step; a GPU's caching allocator, and tcmalloc or jemalloc on a CPU
(which ``python -m torch.backends.xeon.run_cpu`` preloads when it finds them), keep freed
memory for the next allocation. ``--malloc caching`` runs the rows under glibc told to do the
same (``MALLOC_CACHING``: both recipes, in a process of their own), ``--malloc glibc caching``
both ways.

    python benchmarks/e2e.py                                     # CPU: --config small, FP32, 1 and 2 ranks
    python benchmarks/e2e.py --device cuda --config gpt2 --dtype fp16 bf16 --ranks 1
    python benchmarks/e2e.py --quick                             # a tiny rehearsal
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import optree
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))  # the main job's modules: recipe.py
import fzero  # noqa: E402
from fzero import transforms  # noqa: E402
from common import GPT_CONFIGS, fresh_mib, hardware, profile_table, rows_of_ranks, sample_times, table, write_json  # noqa: E402
from fzero.models import gpt  # noqa: E402
from recipe import make_train_step, overlapped_train_step  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CONFIGS = GPT_CONFIGS
LR, WEIGHT_DECAY = 3e-4, 0.1
# glibc keeps freed memory in the process instead of unmapping it: no allocation is served by
# mmap (threshold 4 GiB) and the heap is never trimmed back to the kernel.
MALLOC_CACHING = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296"
# The environment of each allocator setting. thp: torch's CPU allocator aligns buffers of 2 MiB
# and up to 2 MiB and asks the kernel for transparent huge pages there (madvise), so a fresh
# buffer is faulted in 2 MiB at a time instead of 4 KiB (c10's THP_MEM_ALLOC_ENABLE; it needs
# /sys/kernel/mm/transparent_hugepage/enabled at madvise or always). fresh_mib counts a page
# per fault, so under thp it reads low: the kernel zeroes the same bytes in fewer faults.
MALLOCS = {"glibc": {}, "caching": {"GLIBC_TUNABLES": MALLOC_CACHING}, "thp": {"THP_MEM_ALLOC_ENABLE": "1"}}
VARIANTS = {  # fzero recipes --variants can add beside the main job's
    "main": "the main job's make_train_step: compiled loss of the flat buffer + compiled step",
    "new-grads": "the main job's step with a new flat grads buffer from each backward (no grads_into)",
    "grads-buffer": "compiled loss of the params, grads laid out into a flat buffer kept across steps + compiled step",
    "views-outside": "the main job's step with the params' views cut outside the compiled loss (a function of the views)",
    "grads-pytree": "compiled loss of the params, its per-leaf grads as they are + compiled step from the grads pytree",
    "overlapped": "engine.grad_and_value (reduce-scatter inside eager backward) + compiled step",
    # the same two with 16-bit grads sent as an FP32 copy (zero1(wire_dtype=torch.float32)), the
    # behaviour before grads travelled in their own dtype; FP32 params: the same as without
    "main-wire-fp32": "the main job, its BF16/FP16 grads reduce-scattered as an FP32 copy (wire_dtype=torch.float32)",
    "overlapped-wire-fp32": "overlapped, its BF16/FP16 grads reduce-scattered as an FP32 copy (wire_dtype=torch.float32)",
    # eager end to end, the params in 4 MiB buckets: the step's all-gather blocking, or left in
    # flight and waited for per bucket by the next (eager) forward (zero1(overlap_gather=True))
    "eager": "engine.grad_and_value + eager step on the params pytree, 4 MiB buckets",
    "eager-overlap-gather": "eager, the step's all-gather left in flight for the next forward (overlap_gather=True)",
}
OVERLAP_GATHER = "-overlap-gather"
WIRE_FP32 = "-wire-fp32"


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class ModuleGPT(nn.Module):
    """``models.gpt`` as the ``nn.Module`` a torch user writes: the same params, shapes and layout
    (``tests/test_bench_e2e.py`` loads the one's params into the other)."""

    def __init__(self, cfg):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer)])
        self.lnf = nn.LayerNorm(cfg.n_embd)

    def forward(self, idx, tgt):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.lnf(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.view(-1))


def torch_recipe(cfg, dtype, batch, dev, world):
    """One step of the torch recipe (see the module docstring)."""
    torch.manual_seed(0)
    model = ModuleGPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    scaler = torch.amp.GradScaler(dev.type, enabled=dtype == torch.float16)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    fwd = torch.compile(model)

    def step():
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = fwd(*batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def fzero_main_job(cfg, dtype, batch, dev, world, variant: str = "main"):
    """One step of the main job's train step (``examples/recipe.py: make_train_step``), or of a
    variant of it (``VARIANTS``)."""
    master = "params" if dtype == torch.float32 else "fp32"  # as train.py: no second FP32 copy of FP32 params
    wire = torch.float32 if variant.endswith(WIRE_FP32) else None
    overlap = variant.endswith(OVERLAP_GATHER)
    variant = variant.removesuffix(WIRE_FP32).removesuffix(OVERLAP_GATHER)
    buckets = 2**22 if variant == "eager" else None
    engine = fzero.zero1(transforms.adamw(lr=LR, weight_decay=WEIGHT_DECAY), param_dtype=dtype, donate=True,
                         master=master, wire_dtype=wire, bucket_bytes=buckets, overlap_gather=overlap)
    carry = list(engine.init(gpt.init(torch.Generator().manual_seed(0), cfg, device=dev)))
    loss_fn = functools.partial(gpt.loss, config=cfg)
    if variant == "main":
        train_step = make_train_step(engine, loss_fn, compile=True)
    elif variant == "grads-buffer":
        train_step = grads_buffer_train_step(engine, loss_fn)
    elif variant == "views-outside":
        train_step = views_outside_train_step(engine, loss_fn)
    elif variant == "grads-pytree":
        train_step = grads_pytree_train_step(engine, loss_fn)
    elif variant == "new-grads":
        train_step = make_train_step(engine, loss_fn, compile=True, keep_grads=False)
    elif variant == "eager":
        train_step = eager_train_step(engine, loss_fn)
    else:  # "overlapped": engine.grad_and_value (reduce-scatter inside eager backward), compiled step
        train_step = overlapped_train_step(engine, loss_fn, torch.compile(engine.step, fullgraph=True))

    def step():
        carry[0], carry[1], carry[2], _, _ = train_step(*carry, batch)

    return step


def eager_train_step(engine, loss_fn):
    """``engine.grad_and_value`` of the eager loss and the eager ``engine.step`` on the params
    pytree: with ``overlap_gather`` the forward waits for each bucket of params as it reaches it."""
    grad_fn = engine.grad_and_value(loss_fn)

    def train_step(params, state, scaler_state, batch):
        grads, loss = grad_fn(params, scaler_state, batch)
        params, state, scaler_state, info = engine.step(params, grads, state, scaler_state)
        return params, state, scaler_state, loss, info

    return train_step


def leaf_grads(compiled_loss, params, scaler_state, batch):
    """``(loss, grads)``: the loss of ``params`` (its compiled function) and the grads of the
    scaled loss, one per leaf in leaf order, as backward made them (the leaves are detached views
    of the params: no copy)."""
    leaves = optree.tree_map(lambda p: p.detach().requires_grad_(), params)
    loss = compiled_loss(leaves, batch)
    grads = torch.autograd.grad(fzero.scale_loss(loss, scaler_state), optree.tree_leaves(leaves),
                                allow_unused=True, materialize_grads=True)
    return loss, grads


def grads_buffer_train_step(engine, loss_fn):
    """``make_train_step``'s step with the loss a compiled function of the params (as a torch
    user compiles a module) and its per-leaf grads laid out into one flat grads buffer that the
    step allocates once and overwrites every step (``fzero.flatten(..., out=)``), for the
    compiled step on the flat param buffer: no new flat grads buffer each step (on a CPU, fresh
    pages above glibc's mmap threshold), at the cost of an eager pass that lays the grads out."""
    optimizer_step = torch.compile(engine.step, fullgraph=True)
    compiled_loss = torch.compile(loss_fn)
    grads_buffer: list[torch.Tensor] = []

    def train_step(params, state, scaler_state, batch):
        flat = engine.flat_params(params)
        loss, grads = leaf_grads(compiled_loss, params, scaler_state, batch)
        if not grads_buffer:
            grads_buffer.append(torch.zeros_like(flat))
        flat_grads = fzero.flatten(grads, engine.layout, out=grads_buffer[0])
        flat, state, scaler_state, info = optimizer_step(flat, flat_grads, state, scaler_state)
        return fzero.unflatten(flat, engine.layout), state, scaler_state, loss.detach(), info

    return train_step


def views_outside_train_step(engine, loss_fn):
    """``make_train_step``'s step with the params' views cut outside the compiled loss, eagerly by
    ``fzero.unflatten(..., grads_into=)``, and the loss a compiled function of the views: the
    same grads buffer and step, but the graph takes each leaf as an input of its own, so the
    layers' kernels no longer read their weights at constant offsets of one flat input and
    identical layers share their kernels (fewer to build cold: docs/startup.md)."""
    optimizer_step = torch.compile(engine.step, fullgraph=True)
    compiled_loss = torch.compile(loss_fn)
    grads_buffer: list[torch.Tensor] = []

    def train_step(params, state, scaler_state, batch):
        flat = engine.flat_params(params)
        if not grads_buffer:
            grads_buffer.append(torch.zeros_like(flat))
        leaf = flat.detach().requires_grad_()
        loss = compiled_loss(fzero.unflatten(leaf, engine.layout, grads_into=grads_buffer[0]), batch)
        fzero.scale_loss(loss, scaler_state).backward()
        flat, state, scaler_state, info = optimizer_step(flat, grads_buffer[0], state, scaler_state)
        return fzero.unflatten(flat, engine.layout), state, scaler_state, loss.detach(), info

    return train_step


def grads_pytree_train_step(engine, loss_fn):
    """The step a user writes first: the loss a compiled function of the params (as a torch user
    compiles a module), its per-leaf grads as backward made them, and the compiled step from that
    grads pytree (at world size 1 on a CPU, the update leaf by leaf where the kernel runs,
    ``fzero.cpu.leafwise``, and no flat grads buffer; on more ranks the step lays the grad leaves
    out for the reduce-scatter)."""
    optimizer_step = torch.compile(engine.step, fullgraph=True)
    compiled_loss = torch.compile(loss_fn)

    def train_step(params, state, scaler_state, batch):
        loss, grads = leaf_grads(compiled_loss, params, scaler_state, batch)
        grads = optree.tree_unflatten(optree.tree_structure(params), list(grads))
        params, state, scaler_state, info = optimizer_step(params, grads, state, scaler_state)
        return params, state, scaler_state, loss.detach(), info

    return train_step


def block(step, steps: int, world: int):
    """A function that runs ``steps`` steps and, on 2+ ranks, waits for every rank: one timed block."""

    def run():
        for _ in range(steps):
            step()
        if world > 1:
            dist.barrier()

    return run


def measure(args, dtype_name: str, world: int, rank: int, dev) -> dict:
    """tokens/s (over all ranks) of both recipes, alternated, and the fresh MiB per step of each."""
    cfg = CONFIGS[args.config]()
    dtype = DTYPES[dtype_name]
    T = args.seq or cfg.block_size
    g = torch.Generator().manual_seed(rank)
    batch = tuple(torch.randint(0, cfg.vocab_size, (args.batch, T), generator=g).to(dev) for _ in range(2))
    steps = {"torch": torch_recipe(cfg, dtype, batch, dev, world)}
    steps.update({v: fzero_main_job(cfg, dtype, batch, dev, world, v) for v in args.variants})
    # one untimed block each first (compile, first-call work), then they alternate
    blocks = {name: block(step, args.steps, world) for name, step in steps.items()}
    times = sample_times(blocks, dev, iters=args.rounds, warmup=1)
    tokens = args.batch * T * args.steps * world
    out = {"dtype": dtype_name, "ranks": world, "malloc": args.malloc[0], "params": cfg.num_params(),
           "tokens_per_step": args.batch * T * world}
    for name, ts in times.items():
        out[f"{name}_tok_s"] = tokens / statistics.median(ts)
        out[f"{name}_fresh_mib"] = fresh_mib(blocks[name]) / args.steps
    # the ratio within each round (the blocks ran back to back), then the median over rounds:
    # drift in the machine's speed cancels within a round
    for v in args.variants:
        out[f"{v}_ratio"] = statistics.median(t / f for t, f in zip(times["torch"], times[v]))
    if args.profile:  # every rank runs the block (its collectives need them all); rank 0 prints
        for name, run in blocks.items():
            prof = profile_table(run, args.profile)
            if rank == 0:
                print(f"\n{name}, {dtype_name}, {world} rank(s): ops by self CPU time over one block of {args.steps} "
                      f"steps (rank 0)\n{prof}")
    out["fzero_tok_s"], out["ratio"] = out[f"{args.variants[0]}_tok_s"], out[f"{args.variants[0]}_ratio"]
    return out


def run_child(args, world: int, malloc: str) -> list[dict]:
    """The rows at ``world`` ranks under ``malloc`` (``MALLOCS``): this script again, in a process
    of its own (under torchrun for 2+ ranks); rank 0's rows come back."""
    env = dict(MALLOCS[malloc])
    if "GLIBC_TUNABLES" in env:
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), env["GLIBC_TUNABLES"]]))
    return rows_of_ranks(__file__, [*sys.argv[1:], "--malloc", malloc], world, env)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--config", choices=CONFIGS, help="GPT size (default: small on CPU, gpt2 on a GPU; nano with --quick)")
    ap.add_argument("--dtype", nargs="+", choices=DTYPES, help="param dtypes (default: fp32 on CPU, fp16 bf16 on a GPU)")
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2], help="world sizes to measure: %(default)s")
    ap.add_argument("--batch", type=int, help="sequences per rank per step (default: 4 on CPU, 16 on a GPU)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default: the config's block size; 128 on CPU)")
    ap.add_argument("--steps", type=int, help="steps per timed block (default: 3 on CPU, 10 on a GPU)")
    ap.add_argument("--rounds", type=int, help="alternating blocks per recipe (default: 9; 2 with --quick)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=["main"],
                    help="fzero recipes to measure, each against the torch recipe: " +
                    "; ".join(f"{k}: {v}" for k, v in VARIANTS.items()) + " (default: main)")
    ap.add_argument("--malloc", nargs="+", choices=MALLOCS, default=["glibc"],
                    help="CPU allocator settings to run the rows under (see the module docstring): %(default)s")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="after the timing, print each recipe's top ROWS ops by self CPU time (torch.profiler; "
                         "inductor's CPU kernels named)")
    ap.add_argument("--quick", action="store_true", help="a tiny rehearsal: nano config, 1 step per block")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--child-out", help=argparse.SUPPRESS)  # set when this script runs itself under torchrun
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if args.profile:  # before anything compiles: each generated CPU kernel shows as an op of its own
        torch._inductor.config.cpp.enable_kernel_profile = True
    args.config = args.config or ("nano" if args.quick else "gpt2" if cuda else "small")
    args.dtype = args.dtype or (["fp16", "bf16"] if cuda else ["fp32"])
    args.batch = args.batch or (16 if cuda else 2 if args.quick else 4)
    args.seq = args.seq or (None if cuda else 32 if args.quick else 128)
    args.steps = args.steps or (1 if args.quick else 10 if cuda else 3)
    args.rounds = args.rounds or (2 if args.quick else 9)

    if args.child_out:  # run_child's process: a rank under torchrun, or the one process of 1 rank
        ranked = "LOCAL_RANK" in os.environ
        dev = torch.device(args.device, int(os.environ["LOCAL_RANK"])) if cuda and ranked else torch.device(args.device)
        if ranked:
            if cuda:
                torch.cuda.set_device(dev)
            dist.init_process_group("nccl" if cuda else "gloo")
        world, rank = (dist.get_world_size(), dist.get_rank()) if ranked else (1, 0)
        rows = [measure(args, d, world, rank, dev) for d in args.dtype]
        if rank == 0:
            write_json(args.child_out, rows)
        if ranked:
            fzero.shutdown()
        return rows

    dev = torch.device(args.device)
    rows = []
    for malloc in args.malloc:
        for world in args.ranks:
            here = world == 1 and not MALLOCS[malloc]  # this process runs under glibc's defaults
            rows += [measure(args, d, 1, 0, dev) for d in args.dtype] if here else run_child(args, world, malloc)
    cfg = CONFIGS[args.config]()
    print(f"\nGPT '{args.config}' ({cfg.num_params() / 1e6:.2f}M params), {args.batch} x {args.seq or cfg.block_size} "
          f"tokens per rank per step, {hardware(dev)}; median of {args.rounds} alternating blocks of {args.steps} "
          f"steps\n")
    recipes = ["torch", *args.variants]
    print(table([[r["dtype"], r["ranks"], r["malloc"], f"{r['torch_tok_s']:,.0f}"]
                 + [x for v in args.variants for x in (f"{r[f'{v}_tok_s']:,.0f}", f"{r[f'{v}_ratio']:.2f}")]
                 + [f"{r[f'{name}_fresh_mib']:.0f}" for name in recipes] for r in rows],
                ["dtype", "ranks", "malloc", "torch recipe tok/s"]
                + [x for v in args.variants for x in (f"fzero {v} tok/s", f"{v} / torch (paired)")]
                + [f"{name} fresh MiB/step" for name in recipes]))
    if args.json:
        write_json(args.json, {"config": args.config, "device": hardware(dev), "rows": rows})
    print(f"\nfzero/torch tokens/s: {rows[0]['ratio']:.3f}")
    return rows


if __name__ == "__main__":
    main()
