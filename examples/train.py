"""The reference fzero training loop: ZeRO-1 mixed-precision AdamW on a GPT (or an MLP).

    python examples/train.py                                       # one process
    torchrun --standalone --nproc_per_node=2 examples/train.py     # 2 data-parallel ranks
    make train                                                     # nano GPT, FP16, 2 CPU ranks

Every rank samples the same global batch and trains on its own rows of it. The engine
reduce-scatters the grads bucket by bucket while backward still runs (engine.grad_and_value),
updates this rank's 1/N shard of the FP32 master weights and Adam moments, and all-gathers
the new FP16/BF16 params. The default data is character-level
Python: the standard library's own sources (see data.py); --data FILE trains on your text.

The optimizer step is compiled (torch.compile, one graph; --no-compile runs it eagerly), and the
loop syncs the host only at log steps: every --log-every steps, and at the steps that sync anyway
(evaluation, collective timing, checkpoints). Until then the per-step loss, found_inf, loss scale
and grad norm stay 0-d tensors on the device.

Writes <out>/metrics.jsonl: first {"config": ...} (every flag, world size, device, torch and
fzero versions, param count, optimizer-state bytes per rank), then one record per step (written
at the log steps; step_time_s and tokens_per_s are the means over the steps since the last log),
then {"summary": ...} (its "checkpoints" lists the ones saved; after --resume its "resumed" holds
the checkpoint, its step and the hyperparameters the run continued with); and <out>/loss.png
(loss, learning rate, loss scale).

--resume DIR continues a checkpoint at any world size. A checkpoint records the flags that define
the training (--model, --config, --block-size, --mlp-dims, --dtype, --keep-master, --data, --seed,
--batch-size, --steps, --lr, --warmup, --weight-decay, --grad-clip) and --resume takes each one
not given from it, so "--resume DIR" alone continues the saved run exactly. A given one that
differs from the checkpoint's takes effect (a longer run, another learning rate, another seed:
other batches from there on), except the model's -- --model, --config, --block-size, --mlp-dims,
--dtype -- and a --grad-clip that turns clipping on or off: those are flag errors. One line names
the flags taken from the checkpoint (where they differ from the defaults) and the given ones that
differ from it; the config record holds both under "resumed". Resumed into the directory that
holds the checkpoint (--out <run>, --resume <run>/ckpt/step-N), the run continues that directory's
metrics.jsonl: it keeps the records up to step N, drops the later ones (the steps it replaces),
appends a config record and its own, and loss.png plots the whole run. Into another directory the
log starts afresh. Either way skipped_total goes on from the checkpoint's count (the summary's
skipped_steps and steps count this process's steps).

Progress: a tqdm bar on a terminal; without one (a file, a pipe, a terminal with no size) one
line per log step. A bad flag stops the run before any work with one line naming it and a valid
value, exit code 2.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import sys
import time

import optree
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import fzero
import transforms
from data import CharCorpus, TeacherRegression
from models import gpt, mlp

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MLP_DIMS = "64,256,256,64"
GPT_CONFIGS = {  # vocab_size becomes the data's (97 characters); params counted at that vocab
    "nano": lambda: gpt.GPTConfig(97, block_size=64, n_layer=2, n_head=4, n_embd=64),  # 0.11M: minutes on CPU
    "tiny": gpt.GPTConfig.tiny,  # 0.82M
    "small": gpt.GPTConfig.small,  # 10.8M
    "gpt2": gpt.GPTConfig.gpt2,  # 85.9M, for GPUs
}
CONFIG_HELP = ("nano 0.11M params, context 64; tiny 0.82M, 128; small 10.8M, 256; "
               "gpt2 85.9M, 1024 (GPU)")


def make_parser(**kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    p.add_argument("--model", choices=["gpt", "mlp"], default="gpt",
                   help="gpt: a character-level GPT on text; mlp: a regression MLP fit to a fixed teacher "
                        "MLP on random inputs: %(default)s")
    p.add_argument("--config", choices=GPT_CONFIGS, help="GPT size (default nano): " + CONFIG_HELP)
    p.add_argument("--block-size", type=int, help="GPT context length in characters, at most the config's "
                                                  "(default: the config's)")
    p.add_argument("--mlp-dims", help=f"MLP widths, input to output, for --model mlp (default {MLP_DIMS})")
    p.add_argument("--data", metavar="FILE", help="text file for the GPT (default: the Python standard library)")
    p.add_argument("--dtype", choices=DTYPES, default="fp16", help="param dtype (fp16: loss scaling): %(default)s")
    # (not "--master": torchrun would take that for an abbreviation of its --master-addr/-port)
    p.add_argument("--keep-master", choices=["fp32", "remainder"], default="fp32",
                   help="how the optimizer keeps the FP32 master: fp32 (4 bytes/param), or remainder (--dtype bf16: "
                        "the BF16 params + an int16 remainder, 2 bytes, the same training bit for bit): %(default)s")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps: %(default)s")
    p.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch, sequences: %(default)s")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate, warmup then cosine to 1/10: %(default)s")
    p.add_argument("--warmup", type=int, default=30, help="learning-rate warmup steps: %(default)s")
    p.add_argument("--weight-decay", type=float, default=0.01, help="decoupled, matrices only: %(default)s")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm, inf for none: %(default)s")
    p.add_argument("--eval-every", type=int, default=50, help="steps between val losses, and at the end: %(default)s")
    p.add_argument("--eval-batches", type=int, default=4, help="fixed val batches per evaluation: %(default)s")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA if torch sees a GPU (NCCL between ranks), else CPU (gloo): %(default)s")
    p.add_argument("--seed", type=int, default=0, help="seeds the init and the batches: %(default)s")
    p.add_argument("--out", metavar="DIR", help="run directory (default: runs/<model>-<dtype>-<time>)")
    p.add_argument("--profile", metavar="DIR", help="write a chrome trace of steps 3-5 here, one file per rank")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="write a sharded checkpoint to <out>/ckpt/step-<N> every N steps (0: never)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue from this checkpoint (any world size), with its training flags unless given")
    p.add_argument("--bucket-mb", type=float, default=0.0,
                   help="communication buckets of about this many MiB of params (0: one bucket): %(default)s")
    p.add_argument("--comm-every", type=int, default=50, metavar="N",
                   help="every N steps, time each bucket's reduce-scatter and all-gather alone into the log "
                        "(0: never; needs 2+ ranks): %(default)s")
    p.add_argument("--mesh", metavar="R,S",
                   help="hybrid sharding: R replicas x S shards (R*S = ranks; e.g. nodes,GPUs-per-node): the "
                        "optimizer state is sharded over the S ranks of a replica and copied R times "
                        "(default: sharded over all ranks)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the optimizer step (torch.compile, one graph): %(default)s")
    p.add_argument("--check-args", action="store_true",
                   help="only check the flags for WORLD_SIZE ranks (default 1), then exit: 0 if they are valid, "
                        "2 with one line naming the bad one (make train runs this before torchrun)")
    p.add_argument("--log-every", type=int, default=10, metavar="N",
                   help="sync the host every N steps to log them (the metrics keep every step): %(default)s")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return make_parser().parse_args(argv)


def given_flags(argv=None) -> set[str]:
    """The flags the command line gives (their ``dest`` names), whatever their value: the
    arguments parsed again with every default a marker."""
    p, unset = make_parser(), object()
    p.set_defaults(**dict.fromkeys(vars(p.parse_args(argv)), unset))
    return {name for name, value in vars(p.parse_args(argv)).items() if value is not unset}


class UsageError(Exception):
    """A bad flag or combination of flags: one line that names the flag and a valid value."""


def check_args(args, world: int, given: set[str] | None = None) -> dict | None:
    """Reject every bad flag or combination before any work (``UsageError``), and fill in the
    defaults that depend on ``--model``. ``world``: the number of ranks. With ``--resume``, first
    take the training flags not in ``given`` (``given_flags``; None: all of them) from the
    checkpoint and return what ``resume_flags`` says about them."""
    resumed = resume_flags(args, set(vars(args)) if given is None else given) if args.resume else None
    gpt_only = [f for f, v in (("--config", args.config), ("--block-size", args.block_size), ("--data", args.data)) if v]
    if args.model == "mlp" and gpt_only:
        raise UsageError(f"{gpt_only[0]} applies to --model gpt only (drop it, or use --model gpt)")
    if args.model == "gpt" and args.mlp_dims is not None:
        raise UsageError("--mlp-dims applies to --model mlp only (drop it, or use --model mlp)")
    args.config = args.config or "nano"
    if args.model == "mlp":
        args.mlp_dims = args.mlp_dims or MLP_DIMS
        try:
            dims = [int(d) for d in args.mlp_dims.split(",")]
        except ValueError:
            dims = []
        if len(dims) < 2 or min(dims) < 1:
            raise UsageError(f"--mlp-dims {args.mlp_dims!r} must be two or more positive integers, e.g. --mlp-dims {MLP_DIMS}")
    for flag, value, lo in (("--steps", args.steps, 1), ("--batch-size", args.batch_size, 1), ("--warmup", args.warmup, 0),
                            ("--eval-every", args.eval_every, 0), ("--eval-batches", args.eval_batches, 1),
                            ("--log-every", args.log_every, 1), ("--save-every", args.save_every, 0),
                            ("--comm-every", args.comm_every, 0)):
        if value < lo:
            raise UsageError(f"{flag} must be >= {lo}, got {value}")
    for flag, value, example in (("--lr", args.lr, "3e-3"), ("--grad-clip", args.grad_clip, "1.0 (or inf: no clipping)")):
        if not value > 0 or math.isnan(value) or (flag == "--lr" and math.isinf(value)):
            raise UsageError(f"{flag} must be a positive number, got {value:g} (e.g. {flag} {example})")
    for flag, value in (("--weight-decay", args.weight_decay), ("--bucket-mb", args.bucket_mb)):
        if not 0 <= value < math.inf:
            raise UsageError(f"{flag} must be >= 0, got {value:g}")
    if args.model == "gpt" and args.block_size is not None:
        most = GPT_CONFIGS[args.config]().block_size
        if not 1 <= args.block_size <= most:
            raise UsageError(f"--block-size {args.block_size} is outside 1..{most}, the context the {args.config} "
                             f"config is built for (a larger --config has a longer one: {CONFIG_HELP})")
    if args.batch_size % world:
        lower, upper = args.batch_size // world * world, (args.batch_size // world + 1) * world
        valid = f"--batch-size {lower} or {upper}" if lower else f"--batch-size {upper}"
        raise UsageError(f"--batch-size {args.batch_size} must be divisible by the number of ranks ({world}): {valid}")
    if args.mesh is not None:
        try:
            replicas, shards = (int(x) for x in args.mesh.split(","))
        except ValueError:
            replicas = shards = 0
        if min(replicas, shards) < 1:
            raise UsageError(f"--mesh {args.mesh} must be two positive integers R,S (replicas, shards), e.g. --mesh 2,{world // 2 or 1}")
        if replicas * shards != world:
            raise UsageError(f"--mesh {args.mesh} needs {replicas * shards} ranks, this run has {world}")
        args.mesh = (replicas, shards)
    if args.keep_master == "remainder" and args.dtype != "bf16":
        raise UsageError("--keep-master remainder keeps the master below BF16 params: it needs --dtype bf16, "
                         f"got --dtype {args.dtype}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    if resumed and resumed["step"] >= args.steps:
        raise UsageError(f"--resume {args.resume} is at step {resumed['step']}; --steps must be more than that")
    return resumed


# ---------------------------------------------------------------- resuming
# The flags that define the training. A checkpoint records them (extra["flags"]), and --resume
# takes every one the command line does not give from it: "--resume DIR" alone continues the
# saved run exactly. MODEL_FLAGS fix the model and its optimizer state, so a value other than
# the checkpoint's is a flag error. The others may change on resume -- a longer run, another
# learning rate or seed (the batches after the resumed step then differ), the remainder master
# on or off (the checkpoint holds the FP32 master and loads into either) -- and take effect; the
# run names them. The world size, --mesh, logging, evaluation and checkpointing are free.
MODEL_FLAGS = ("model", "config", "block_size", "mlp_dims", "dtype")
TRAINING_FLAGS = (*MODEL_FLAGS, "keep_master", "data", "seed", "batch_size", "steps", "lr", "warmup", "weight_decay",
                  "grad_clip")
DTYPE_FLAG = {str(dtype).removeprefix("torch."): name for name, dtype in DTYPES.items()}  # a manifest's param_dtype


def flag(name: str, value=None) -> str:
    """``"--block-size"`` for ``"block_size"``; with a value, ``"--block-size 32"``."""
    spelled = "--" + name.replace("_", "-")
    return spelled if value is None else f"{spelled} {value}"


def against_checkpoint(name: str, value, saved) -> str:
    """``"--dtype fp16 (checkpoint: bf16)"``."""
    return f"{flag(name, value)} (checkpoint: {'none' if saved is None else saved})"


def training_flags(args) -> dict:
    """The training flags of ``args`` as a checkpoint records them: the defaults that depend on
    ``--model`` filled in, None for the other model's flags, ``--data`` as an absolute path, a
    non-finite float as its string (strict JSON: ``--grad-clip inf``)."""
    is_gpt, config = args.model == "gpt", args.config or "nano"
    flags = {name: getattr(args, name) for name in TRAINING_FLAGS}
    flags.update(config=config if is_gpt else None,
                 block_size=(args.block_size or GPT_CONFIGS[config]().block_size) if is_gpt else None,
                 mlp_dims=None if is_gpt else ",".join(d.strip() for d in (args.mlp_dims or MLP_DIMS).split(",")),
                 data=os.path.abspath(args.data) if is_gpt and args.data else None)
    return {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in flags.items()}


def resume_flags(args, given: set[str]) -> dict:
    """Read the ``--resume`` checkpoint (no process group needed) and set each training flag not
    in ``given`` to its value there. ``UsageError`` if it is not a checkpoint, or for given
    flags that contradict it: MODEL_FLAGS, and --grad-clip turning clipping on or off (that
    adds or removes the clipping state). Returns the metrics record's ``"resumed"``: the
    checkpoint, its step, the flags taken from it that differ from this command's defaults
    (``from_checkpoint``), and the given ones that differ from it (``changed``: [saved, given]).

    A checkpoint saved before ``extra["flags"]`` existed still gives its param dtype (every
    manifest has it) and ``extra["seed"]``."""
    try:
        manifest = fzero.checkpoint.read_manifest(args.resume)
    except (OSError, fzero.checkpoint.CheckpointError) as e:
        raise UsageError(f"--resume {args.resume}: not a checkpoint ({str(e).splitlines()[0]})") from None
    extra = manifest["extra"]
    recorded = extra.get("flags")
    if not isinstance(recorded, dict):  # saved before extra["flags"]
        recorded = {"seed": extra["seed"]} if "seed" in extra else {}
    recorded = {k: v for k, v in {"dtype": DTYPE_FLAG.get(manifest["param_dtype"]), **recorded}.items()
                if k in TRAINING_FLAGS}
    try:  # the saved values through this parser: its types and choices
        from_ckpt = make_parser(exit_on_error=False).parse_args(
            [f"{flag(k)}={v}" for k, v in recorded.items() if v is not None])
    except argparse.ArgumentError as e:
        raise UsageError(f"--resume {args.resume}: the checkpoint's training flags are not this train.py's ({e})") from None
    defaults = training_flags(args)
    for name in recorded.keys() - given:
        setattr(args, name, getattr(from_ckpt, name))
    saved = {k: v for k, v in training_flags(from_ckpt).items() if k in recorded}
    # (a given flag of the other model, --config of an MLP, as given: check_args rejects it later)
    now = {k: getattr(args, k) if v is None and k in given else v for k, v in training_flags(args).items()}
    differ = [k for k in saved if k in given and now[k] != saved[k]]
    wrong = [k for k in differ if k in MODEL_FLAGS]
    if wrong:
        listed = ", ".join(against_checkpoint(k, now[k], saved[k]) for k in wrong)
        raise UsageError(f"--resume {args.resume}: {listed}: these flags fix the model and its optimizer state; "
                         "drop them to continue with the checkpoint's")
    if "grad_clip" in differ and (saved["grad_clip"] == "inf") != (now["grad_clip"] == "inf"):
        off = now["grad_clip"] == "inf"
        raise UsageError(f"--resume {args.resume}: {against_checkpoint('grad_clip', now['grad_clip'], saved['grad_clip'])} "
                         f"turns clipping {'off' if off else 'on'}, which changes the optimizer state; drop it to keep "
                         f"{saved['grad_clip']}" + (" (a large --grad-clip such as 1e9 clips nothing)" if off else ""))
    return {"from": args.resume, "step": extra.get("step", 0),
            "from_checkpoint": {k: v for k, v in saved.items() if k not in given and v != defaults[k] and v is not None},
            "changed": {k: [saved[k], now[k]] for k in differ}}


def resume_line(resumed: dict) -> str | None:
    """The one line that says which training flags a resumed run took from the checkpoint and
    which given ones differ from it; None when the command line and the checkpoint agree."""
    parts = []
    if resumed["from_checkpoint"]:
        parts.append("with the checkpoint's " + " ".join(flag(k, v) for k, v in resumed["from_checkpoint"].items()))
    if resumed["changed"]:
        parts.append("with flags that differ from it: " + ", ".join(
            against_checkpoint(k, now, saved) for k, (saved, now) in resumed["changed"].items()))
    return f"resuming {resumed['from']} at step {resumed['step']} " + ", and ".join(parts) if parts else None


def load_data(args):
    """The dataset of ``--model``/``--data``/``--block-size`` (``UsageError`` for a bad file)."""
    if args.model == "mlp":
        return TeacherRegression(tuple(int(d) for d in args.mlp_dims.split(",")))
    T = args.block_size or GPT_CONFIGS[args.config]().block_size
    if not args.data:
        return CharCorpus.from_stdlib(T)
    try:  # ValueError: not a regular file, empty, too short for one block
        return CharCorpus.from_file(args.data, T)
    except (OSError, ValueError) as e:
        raise UsageError(f"--data {args.data}: {e}") from None


def make_mesh(spec, device: torch.device):
    """The ``("replicate", "shard")`` device mesh of ``--mesh R,S`` (``None`` without it)."""
    return None if spec is None else init_device_mesh(device.type, spec, mesh_dim_names=("replicate", "shard"))


# ---------------------------------------------------------------- processes
def init_distributed(device: str) -> tuple[torch.device, int, int]:
    """``(device, rank, world_size)``. Under torchrun (WORLD_SIZE is set) join the process
    group, NCCL on CUDA and gloo on CPU; run as a plain script, be one process without one."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if "WORLD_SIZE" not in os.environ:
        return device, 0, 1
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))
    return device, dist.get_rank(), dist.get_world_size()


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """Mean over ranks of a small tensor (for logging only)."""
    if not dist.is_initialized():
        return x
    x = x.detach().clone()
    dist.all_reduce(x)
    return x / dist.get_world_size()


def gather_to_all(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------- data and model
def build(args, data, device):
    """``(params_fp32, loss_fn, items per sequence)`` for ``--model``, on ``data``."""
    seed = torch.Generator().manual_seed(args.seed)
    if args.model == "gpt":
        config = GPT_CONFIGS[args.config]()
        config = dataclasses.replace(config, vocab_size=data.vocab_size, block_size=data.block_size)
        return gpt.init(seed, config, device=device), functools.partial(gpt.loss, config=config), data.block_size
    dims = tuple(int(d) for d in args.mlp_dims.split(","))
    return mlp.init(seed, dims, device=device), mlp.loss, 1


# ---------------------------------------------------------------- the optimizer
def decays(params):
    """Which leaves get weight decay: matrices (weights, embeddings), not biases or norm
    gains -- nanoGPT's rule, ``ndim >= 2``."""
    return optree.tree_map(lambda x: x.ndim >= 2, params)


def lr_schedule(args):
    """Warmup from 0 to --lr over --warmup steps, then cosine to --lr/10 at --steps: a function
    of the count of applied updates (a 0-d tensor)."""
    warmup = min(args.warmup, args.steps - 1)  # the decay needs at least one step
    return transforms.warmup_cosine_decay(0.0, args.lr, warmup, args.steps, end_value=args.lr / 10)


def schedule_count(state) -> torch.Tensor:
    """The count the learning-rate schedule reads, from the optimizer state (a 0-d tensor)."""
    is_sched = lambda x: isinstance(x, transforms.scale.ScaleByScheduleState)  # noqa: E731
    return next(x.count for x in optree.tree_leaves(state.tx_state, is_leaf=is_sched) if is_sched(x))


def make_optimizer(args) -> transforms.GradientTransformation:
    """Clip by the global grad norm (over all ranks), then AdamW with a warmup-cosine learning
    rate (``lr_schedule``) and decoupled weight decay on the matrices only (``decays``)."""
    lr = lr_schedule(args)
    clip = [] if math.isinf(args.grad_clip) else [transforms.clip_by_global_norm(args.grad_clip)]
    adamw = transforms.adamw(lr=lr, betas=(0.9, 0.99), weight_decay=args.weight_decay, weight_decay_mask=decays)
    return transforms.chain(*clip, adamw)


# ---------------------------------------------------------------- the step
def make_train_step(engine, loss_fn, *, compile: bool):
    """``train_step(params, state, scaler_state, batch) -> (params, state, scaler_state, loss,
    info)``: one optimizer step with no host sync. ``loss`` is this rank's unscaled loss and
    ``info`` the engine's, 0-d tensors on the device.

    The grads come back already reduce-scattered: each bucket's collective starts inside
    backward (``engine.grad_and_value``). With ``compile``, ``engine.step`` is one compiled
    graph; the learning rate and the loss scale are tensors in the state, so changing them never
    recompiles it.

    Why not the whole step in one graph (forward, backward and ``engine.step``, differentiating
    ``engine.flat_params``)? Measured on ``make train``'s config (docs/performance.md): it
    compiles in about twice the time (29 s against 13 s from a cold cache, 2 ranks on 2 cores)
    for steps only ~6% faster, since three quarters of a step are FP16 matmuls that run the same
    aten kernels either way; so 600 steps end sooner this way, and backward keeps overlapping the
    reduce-scatter (``grad_and_value`` is eager only)."""

    def scaled_loss(params, batch, scaler_state):
        loss = loss_fn(params, batch)
        return fzero.scale_loss(loss, scaler_state), loss.detach()  # the unscaled loss rides along

    grad_fn = engine.grad_and_value(scaled_loss, has_aux=True)
    optimizer_step = torch.compile(engine.step, fullgraph=True) if compile else engine.step

    def train_step(params, state, scaler_state, batch):
        grads, (_, loss) = grad_fn(params, batch, scaler_state)
        # The step on the flat buffer the leaves are views of: compiled, it writes the new params
        # in the update's own pass; a pytree costs a pass per leaf (docs/performance.md).
        flat, state, scaler_state, info = optimizer_step(engine.flat_params(params), grads, state, scaler_state)
        return fzero.unflatten(flat, engine.layout), state, scaler_state, loss, info

    return train_step


@torch.no_grad()
def evaluate(params, loss_fn, batches) -> float:
    """Mean loss over ``batches`` (this rank's rows), averaged over ranks."""
    return mean_over_ranks(torch.stack([loss_fn(params, b) for b in batches]).mean()).item()


class LogWindow:
    """The steps since the last log step. Their per-step quantities (loss, found_inf, loss
    scale, grad norm) stay 0-d tensors on the device until ``drain`` converts them all at once,
    so the loop syncs the host once per window, not once per step."""

    INFO_KEYS = ("found_inf", "loss_scale", "grad_norm", "scale_stuck", "lr")

    def __init__(self, tokens_per_step: int, state_bytes: int, skipped: int = 0):
        self.tokens_per_step, self.state_bytes = tokens_per_step, state_bytes
        self.skipped = skipped  # over the whole run: a resumed run starts from the checkpoint's count
        self.steps, self.losses, self.infos = [], [], []
        self.restart_clock()

    def restart_clock(self):
        """The window's step time counts from now."""
        self.t0 = time.perf_counter()

    def add(self, step: int, loss: torch.Tensor, info: dict, lr: torch.Tensor):
        """Keep one step's 0-d loss, engine ``info`` and learning rate, as they are (no sync)."""
        self.steps.append(step)
        self.losses.append(loss)
        self.infos.append({**info, "lr": lr})

    def drain(self) -> tuple[list[dict], bool]:
        """``(records, stuck)``: one metrics record per step of the window (``val_loss`` None),
        and whether the loss scale was stuck at any of them; the window is then empty. One
        all-reduce (the losses' mean over ranks) and one host sync for the whole window. The
        step time is the window's wall time per step: the sync ends it, so it is the time the
        device took too, not just the time to queue the work."""
        columns = {"loss": mean_over_ranks(torch.stack(self.losses))}
        columns.update({k: torch.stack([info[k] for info in self.infos]) for k in self.INFO_KEYS})
        columns = {k: v.tolist() for k, v in columns.items()}  # the host sync
        step_time = (time.perf_counter() - self.t0) / len(self.steps)
        records = []
        for i, step in enumerate(self.steps):
            self.skipped += columns["found_inf"][i]
            records.append({
                "step": step,
                "loss": finite_or_none(columns["loss"][i]),
                "val_loss": None,
                "lr": columns["lr"][i],
                "loss_scale": columns["loss_scale"][i],
                "found_inf": columns["found_inf"][i],
                "skipped_total": self.skipped,
                "grad_norm": finite_or_none(columns["grad_norm"][i]),
                "step_time_s": step_time,
                "tokens_per_s": self.tokens_per_step / step_time,
                "opt_state_bytes": self.state_bytes,
            })
        self.steps, self.losses, self.infos = [], [], []
        return records, any(columns["scale_stuck"])


class Progress:
    """The loop's steps, with progress on rank 0: a tqdm bar on a sized terminal; otherwise (a
    file, a pipe, a terminal with no size: CI, ``docker exec``) one plain line per log step."""

    def __init__(self, show: bool, first: int, last: int):
        self.show, self.last, self.val = show, last, None
        self.steps = range(first, last + 1)
        self.bar = tqdm(self.steps, unit="step", dynamic_ncols=True) if show and sized_terminal() else None

    def __iter__(self):
        return iter(self.bar if self.bar is not None else self.steps)

    def log(self, r: dict) -> None:
        """Show a log step's record (loss, val loss, lr, loss scale, tokens/s)."""
        if not self.show:
            return
        self.val = r["val_loss"] if r["val_loss"] is not None else self.val
        fields = {"loss": "n/a" if r["loss"] is None else f"{r['loss']:.3f}",
                  "val": "-" if self.val is None else f"{self.val:.3f}", "lr": f"{r['lr']:.2e}",
                  "scale": f"{r['loss_scale']:g}", "tok_s": f"{r['tokens_per_s']:,.0f}"}
        if self.bar is not None:
            self.bar.set_postfix(fields)
        else:
            print(f"step {r['step']}/{self.last} | " + " | ".join(f"{k} {v}" for k, v in fields.items()), flush=True)

    def write(self, line: str) -> None:
        if self.show:
            (self.bar.write if self.bar is not None else functools.partial(print, flush=True))(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def open_metrics(out: str, resume: str | None, step: int):
    """``(file, earlier step records)``: ``<out>/metrics.jsonl`` opened for this run's records.

    A run resumed from a checkpoint inside ``out`` (its own ``<out>/ckpt/step-N``) continues the
    file: it keeps the lines up to the record of the resumed ``step`` -- the summary of a run
    that ended there too -- and drops the rest (the steps this run replaces, and the config and
    summary records of the run that took them); the kept step records come back for the plot.
    Any other run starts the file afresh."""
    path = os.path.join(out, "metrics.jsonl")
    inside = resume and os.path.commonpath([os.path.realpath(resume), os.path.realpath(out)]) == os.path.realpath(out)
    if not (inside and os.path.isfile(path)):
        return open(path, "w"), []
    earlier, read, keep = [], 0, 0
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a crash: neither it nor what follows is kept
                break
            if not (isinstance(record, dict) and line.endswith(b"\n")) or record.get("step", 0) > step:
                break
            read += len(line)
            if "step" in record:
                earlier.append(record)
            if "config" not in record:  # a config record is kept only with a step after it: it starts a run
                keep = read
    os.truncate(path, keep)
    return open(path, "a"), earlier


def sized_terminal() -> bool:
    """stderr (where tqdm draws) is a terminal that reports a width."""
    try:
        return sys.stderr.isatty() and os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (OSError, ValueError):
        return False


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def fzero_version() -> str:
    try:
        return importlib.metadata.version("fzero")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------- main
RANK_0_REPORT_WAIT_S = 60.0


def _rank_0_reported() -> bool:
    """On a rank other than 0 that found a bad flag: leave the report to rank 0.

    Rank 0 runs the same check on the same flags, fails too and prints the one line. Under
    torchrun this rank must not exit first: torchrun's agent stops every worker (SIGTERM) as
    soon as one exits with an error, which could cut rank 0 off before its line reached stderr.
    So it waits to be stopped. If it is still running after ``RANK_0_REPORT_WAIT_S``, rank 0 did
    not fail (the ranks were given different flags or files) and this rank reports the error
    itself (returns False).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not torchrun's worker: nobody cuts rank 0 off
        return True
    time.sleep(RANK_0_REPORT_WAIT_S)
    return False


def main(argv=None):
    args = parse_args(argv)
    # Every bad flag fails here, before any rank joins a group or builds a model: one line, from
    # rank 0 only, exit code 2 (argparse's convention).
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    try:
        resume = check_args(args, world, given_flags(argv))  # with --resume: the flags it took from the checkpoint
        data = load_data(args)
    except UsageError as e:
        if rank == 0:
            print(f"train.py: error: {e}", file=sys.stderr)
        elif not _rank_0_reported():
            print(f"train.py: error (rank {rank}): {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.check_args:
        return
    device, rank, world = init_distributed(args.device)
    lo, hi = rank * args.batch_size // world, (rank + 1) * args.batch_size // world

    def my_rows(batch):  # this rank's contiguous rows of a global batch
        return tuple(t[lo:hi].to(device) for t in batch)

    params_fp32, loss_fn, seq_items = build(args, data, device)

    # fzero: the optimizer (optax-style transforms), the engine, its state.
    tx = make_optimizer(args)
    dtype = DTYPES[args.dtype]
    loss_scale = fzero.DynamicLossScale() if dtype == torch.float16 else None  # BF16 and FP32 need none
    bucket_bytes = int(args.bucket_mb * 2**20) or None
    # donate: the loop never reuses a step's inputs, so the step writes state and params in place
    # (no new shard-sized buffers each step; on a CPU those are fresh pages from the OS).
    mesh = make_mesh(args.mesh, device)  # None: ZeRO-1 over all ranks
    engine = fzero.zero1(tx, param_dtype=dtype, loss_scale=loss_scale, bucket_bytes=bucket_bytes, donate=True, mesh=mesh,
                         master=args.keep_master)
    shards = engine.comm.world_size  # the optimizer state is split over these ranks
    params, state, scaler_state = engine.init(params_fp32)  # params in --dtype; FP32 state, 1/N of it

    state_bytes = engine.state_bytes(state)
    n_params = engine.layout.numel
    tokens_per_step = args.batch_size * seq_items
    val_batches = [my_rows(data.get_batch("val", i, args.batch_size, args.seed)) for i in range(args.eval_batches)]

    name = f"gpt {args.config}" if args.model == "gpt" else f"mlp {args.mlp_dims}"
    out = args.out or os.path.join("runs", f"{args.model}-{args.dtype}-{time.strftime('%Y%m%d-%H%M%S')}")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        if resume and resume_line(resume):
            print(resume_line(resume))
        print(f"{name}: {n_params:,} params | {args.dtype} | {world} rank(s) on {device.type} | {data}")
        how = f"{args.mesh[0]} replicas x {shards} shards" if args.mesh else f"{shards} shard(s)"
        kept = "int16 master remainder" if args.keep_master == "remainder" else "FP32 master"
        print(f"optimizer state: {state_bytes / 2**20:.2f} MiB per rank ({kept} + 2 moments + the decay mask, 1/{shards} each: "
              f"{how}); {len(engine.layout.buckets)} communication bucket(s)")

    first_step, resumed, extra = 1, None, {}
    if args.resume:  # same model and optimizer, any world size; batches are seeded by step
        # The hyperparameters of this command line (--weight-decay, --grad-clip) take effect;
        # load warns about each one that differs from the checkpoint's.
        params, state, scaler_state, extra = fzero.checkpoint.load(args.resume, engine)
        first_step = extra["step"] + 1
        hyperparams = {name: float(v) for name, v in transforms.get_hyperparams(state).items()}  # once, before the loop
        resumed = {"from": args.resume, "step": extra["step"], "hyperparams": hyperparams}
        if rank == 0:
            print(f"resumed from {args.resume} at step {extra['step']} with hyperparameters {json.dumps(hyperparams)}")

    # Opened once the checkpoint has loaded: a resume that fails leaves the run's log as it was.
    log, earlier = open_metrics(out, args.resume, first_step - 1) if rank == 0 else (None, [])
    if log:  # the run's settings (after a resume, from the resumed step on), to read a log without its command line
        config = {"args": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()},
                  "world_size": world, "device": str(device), "torch": torch.__version__, "fzero": fzero_version(),
                  "param_count": n_params, "opt_state_bytes_per_rank": state_bytes}
        if resume:
            config["resumed"] = resume
        log.write(json.dumps({"config": config}) + "\n")

    train_step = make_train_step(engine, loss_fn, compile=args.compile)
    lr_fn = lr_schedule(args)
    window = LogWindow(tokens_per_step, state_bytes, skipped=extra.get("skipped_total", 0))  # over the whole run
    records, warned_stuck, saved, flags = [], False, [], training_flags(args)
    profiler = make_profiler(args.profile, rank) if args.profile else contextlib.nullcontext()
    progress = Progress(rank == 0, first_step, args.steps)
    start = time.perf_counter()
    with profiler as prof:
        for step in progress:
            batch = my_rows(data.get_batch("train", step, args.batch_size, args.seed))
            lr = lr_fn(schedule_count(state))  # the rate this step applies (a device tensor)
            params, state, scaler_state, loss, info = train_step(params, state, scaler_state, batch)
            window.add(step, loss, info, lr)  # still tensors: no host sync between log steps

            # A log step: every --log-every steps, the last one, and the steps that sync anyway
            # (evaluation, collective timing, checkpoint). The window's only host sync is here.
            evaluate_now = step == args.steps or (args.eval_every > 0 and step % args.eval_every == 0)
            time_comm_now = args.comm_every and world > 1 and (step % args.comm_every == 0 or step == first_step)
            save_now = args.save_every and (step % args.save_every == 0 or step == args.steps)
            if step % args.log_every == 0 or step == args.steps or evaluate_now or time_comm_now or save_now:
                new, stuck = window.drain()
                if evaluate_now:
                    new[-1]["val_loss"] = evaluate(params, loss_fn, val_batches)
                if time_comm_now:
                    comm = engine.time_collectives()  # per bucket, each alone, max over ranks
                    new[-1]["comm_ms"] = {k: [round(t, 3) for t in ts] for k, ts in comm.items()}
                records += new
                if log:
                    log.writelines(json.dumps(r) + "\n" for r in new)
                    log.flush()
                progress.log(new[-1])
                if stuck and not warned_stuck:  # rare: find the culprits off the hot path
                    warned_stuck = True
                    warn_stuck(loss_fn, params, scaler_state, batch, rank)
                if save_now:
                    path, t0 = os.path.join(out, "ckpt", f"step-{step}"), time.perf_counter()
                    fzero.checkpoint.save(path, params, state, scaler_state, engine,  # extra: what --resume reads
                                          extra={"step": step, "skipped_total": window.skipped, "flags": flags})
                    saved.append(path)
                    progress.write(f"saved checkpoint {path} ({dir_bytes(path) / 2**20:.2f} MiB, "
                                   f"{time.perf_counter() - t0:.2f} s)")
                window.restart_clock()  # evaluation, timing and checkpoints are not step time
            if prof:
                prof.step()
    total_time = time.perf_counter() - start
    progress.close()

    # Every rank hashes its full param buffer: ZeRO-1 must leave them bit-identical.
    digests = gather_to_all(sha256(fzero.flatten(params, engine.layout)))
    summary = summarize(records, args, world, n_params, state_bytes, tokens_per_step, total_time, digests)
    summary["checkpoints"] = saved
    if resumed:
        summary["resumed"] = resumed
    if rank == 0:
        log.write(json.dumps({"summary": summary}) + "\n")
        log.close()
        plot_path = plot(earlier + records, os.path.join(out, "loss.png"), title=f"{name}, {args.dtype}, {world} rank(s)")
        print_summary(summary, log.name, plot_path, args.profile)
    fzero.shutdown()  # every rank leaves together and the process group's threads end here


def warn_stuck(loss_fn, params, scaler_state, batch, rank):
    """The loss scale sits at its minimum and grads are still non-finite: name the leaves."""
    grads = torch.func.grad(lambda p: fzero.scale_loss(loss_fn(p, batch), scaler_state))(params)
    culprits = gather_to_all(fzero.nonfinite_leaves(grads))
    if rank == 0:
        where = "; ".join(f"rank {r}: {', '.join(c)}" for r, c in enumerate(culprits) if c) or "no leaf (the reduction)"
        tqdm.write(f"WARNING: loss scale stuck at {float(scaler_state.scale):g}: overflow persists at the minimum scale. "
                   f"Non-finite grads in {where}")


# ---------------------------------------------------------------- reporting
def finite_or_none(x: float):
    return x if math.isfinite(x) else None  # JSON has no inf/NaN


def sha256(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous().clone()  # a tensor that owns exactly its bytes
    return hashlib.sha256(bytes(t.untyped_storage())).hexdigest()


def make_profiler(trace_dir, rank):
    """Skip 1 step, warm up 1, record 3; then write a chrome trace (Perfetto, TensorBoard)."""
    os.makedirs(trace_dir, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(os.path.join(trace_dir, f"trace_rank{rank}.json")),
    )


def summarize(records, args, world, n_params, state_bytes, tokens_per_step, total_time, digests) -> dict:
    val = [r["val_loss"] for r in records if r["val_loss"] is not None]
    return {
        "model": args.model,
        "dtype": args.dtype,
        "steps": len(records),
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "final_val_loss": val[-1] if val else None,
        "best_val_loss": min(val) if val else None,
        "skipped_steps": sum(r["found_inf"] for r in records),
        "total_time_s": total_time,
        "mean_tokens_per_s": len(records) * tokens_per_step / total_time,
        "world_size": world,
        "global_batch_size": args.batch_size,
        "param_count": n_params,
        "opt_state_bytes_per_rank": state_bytes,
        "params_sha256": digests,
        "params_identical_across_ranks": len(set(digests)) == 1,
    }


def print_summary(s, log_path, plot_path, trace_dir):
    fmt = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
    unit = "tokens" if s["model"] == "gpt" else "samples"
    same = "identical on every rank" if s["params_identical_across_ranks"] else "DIFFER across ranks"
    rows = [
        ("steps", f"{s['steps']} ({s['skipped_steps']} skipped on overflow)"),
        ("train loss", f"{fmt(s['first_loss'])} -> {fmt(s['final_loss'])}"),
        ("val loss", f"{fmt(s['final_val_loss'])} (best {fmt(s['best_val_loss'])})"),
        ("time", f"{s['total_time_s']:.1f} s, {s['mean_tokens_per_s']:,.0f} {unit}/s"),
        ("params", f"{s['param_count']:,} ({s['dtype']})"),
        ("optimizer state", f"{s['opt_state_bytes_per_rank']:,} bytes per rank, {s['world_size']} rank(s)"),
        ("params sha256", f"{s['params_sha256'][0][:16]}... {same}"),
        ("metrics", log_path),
        ("plot", plot_path or "not written (matplotlib is not installed)"),
    ]
    if s["checkpoints"]:
        rows.append(("checkpoints", ", ".join(s["checkpoints"])))
    if trace_dir:
        rows.append(("profile", trace_dir))
    print()
    for name, value in rows:
        print(f"  {name:<16} {value}")


def plot(records, path, title):
    """Train and val loss against steps, and below them the learning rate and the loss scale,
    as a PNG; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [(r["step"], r["loss"]) for r in records if r["loss"] is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r["val_loss"] is not None]
    skipped = [(r["step"], r["loss"]) for r in records if r["found_inf"] and r["loss"] is not None]
    fig, (ax, low) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax.plot(*zip(*train), lw=1, label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="val")
    if skipped:
        ax.plot(*zip(*skipped), "rx", label="skipped step (overflow)")
    ax.set(ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    steps = [r["step"] for r in records]
    low.plot(steps, [r["lr"] for r in records], color="tab:green", lw=1)
    low.set(xlabel="step", ylabel="learning rate")
    low.grid(alpha=0.3)
    scale = low.twinx()  # the loss scale spans orders of magnitude: its own log axis
    scale.plot(steps, [r["loss_scale"] for r in records], color="tab:purple", lw=1)
    scale.set(ylabel="loss scale", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
