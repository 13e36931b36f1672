"""The main job's flags (examples/train.py): the parser, the checks that reject a bad flag or
combination before any work (``UsageError``: one line naming the flag and a valid value), and
what ``--resume`` reads from a checkpoint -- the training flags it records, which of them the
command line may change and the one line that says what was taken and what differs.
"""
from __future__ import annotations

import argparse
import math
import os

import torch

import fzero.checkpoint
from fzero.models import gpt

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MLP_DIMS = "64,256,256,64"
MOMENTS = {"fp32": None, "bf16": torch.bfloat16, "int8": torch.int8}  # --moments: scale_by_adam's mu_dtype/nu_dtype
OPTIMIZERS = ("adamw", "muon", "lion", "ademamix", "lamb", "schedule_free", "adafactor")  # --optimizer: examples/recipe.py's make_optimizer
GPT_CONFIGS = {  # vocab_size becomes the data's (97 characters); params counted at that vocab
    "nano": lambda: gpt.GPTConfig(97, block_size=64, n_layer=2, n_head=4, n_embd=64),  # 0.11M: minutes on CPU
    "tiny": gpt.GPTConfig.tiny,  # 0.82M
    "small": gpt.GPTConfig.small,  # 10.8M
    "gpt2": gpt.GPTConfig.gpt2,  # 85.9M, for GPUs
}
CONFIG_HELP = ("nano 0.11M params, context 64; tiny 0.82M, 128; small 10.8M, 256; "
               "gpt2 85.9M, 1024 (GPU)")


def make_parser(**kwargs) -> argparse.ArgumentParser:
    """The main job's flags; ``kwargs`` go to ``ArgumentParser`` (train.py passes its docstring as the
    description: ``--help`` shows it)."""
    p = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
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
    p.add_argument("--keep-master", choices=["fp32", "remainder", "params"],
                   help="how the optimizer keeps the FP32 master: fp32 (4 bytes/param), remainder (--dtype bf16: "
                        "the BF16 params + an int16 remainder, 2 bytes), or params (--dtype fp32: the params "
                        "themselves, 0 bytes); the same training bit for bit (default: params with --dtype fp32, "
                        "else fp32)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw on every param, or muon: Muon (orthogonalized momentum, its update scaled to AdamW's "
                        "RMS, so --lr and --weight-decay carry over) on the blocks' weight matrices and AdamW on "
                        "the embeddings, LayerNorms and biases, the nanoGPT-speedrun split (--model gpt); or lion: "
                        "Lion (the sign of an interpolation of the momentum and the grad; one momentum, stored as "
                        "--moments says) on every param, with the same schedule and decay mask: give it about 1/10 of "
                        "AdamW's --lr and 10x its --weight-decay (the paper's advice); or ademamix: AdEMAMix (AdamW "
                        "with a slow momentum, betas 0.9, 0.99, 0.999 and alpha 5, three fp32 moments) on every "
                        "param, with the same schedule and decay mask; or lamb: LAMB (AdamW's direction, each "
                        "param's step scaled to --lr times its norm) on every param, the same schedule and decay "
                        "mask; or schedule_free: Schedule-Free AdamW (the warmup, then --lr without decay; "
                        "evaluated at its averaged params) on every param, the same decay mask; or adafactor: "
                        "Adafactor (a factored second moment, 4 bytes per row and column of each matrix; its step "
                        "relative to each param's RMS, so give it a larger --lr) on every param, the same schedule "
                        "and decay mask: %(default)s")
    p.add_argument("--moments", choices=list(MOMENTS), default="fp32",
                   help="how AdamW stores its two moments: fp32 (4+4 bytes/param), bf16 (2+2), or int8 (8-bit codes "
                        "with one FP32 scale per 256 elements: ~1+1); Lion its one momentum, fp32 or bf16; the math is "
                        "FP32 (default: %(default)s)")
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
                   help="compile the optimizer step (one graph) and, with one bucket, the loss of the flat "
                        "param buffer (torch.compile): %(default)s")
    p.add_argument("--check-args", action="store_true",
                   help="only check the flags for WORLD_SIZE ranks (default 1), then exit: 0 if they are valid, "
                        "2 with one line naming the bad one (make train runs this before torchrun)")
    p.add_argument("--log-every", type=int, default=10, metavar="N",
                   help="sync the host every N steps to log them (the metrics keep every step): %(default)s")
    return p


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    return make_parser(description=description).parse_args(argv)


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
    check_batch_size(args.batch_size, world)
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
    if args.optimizer == "muon":
        if args.model != "gpt":
            raise UsageError("--optimizer muon trains the GPT's blocks' matrices with Muon: it needs --model gpt")
        if args.moments == "int8":
            raise UsageError("--moments int8 keeps AdamW's moments in blocks of 256 elements, which the AdamW group "
                             "of --optimizer muon does not align to: use --moments bf16 or fp32")
    if args.optimizer == "lion" and args.moments == "int8":
        raise UsageError("--optimizer lion keeps one momentum in fp32 or bf16: use --moments fp32 or bf16, not int8")
    if args.optimizer in ("ademamix", "lamb", "schedule_free", "adafactor") and args.moments != "fp32":
        raise UsageError(f"--optimizer {args.optimizer} keeps its moments in fp32: use --moments fp32, not {args.moments}")
    args.keep_master = keep_master(args)
    if args.keep_master == "remainder" and args.dtype != "bf16":
        raise UsageError("--keep-master remainder keeps the master below BF16 params: it needs --dtype bf16, "
                         f"got --dtype {args.dtype}")
    if args.keep_master == "params" and args.dtype != "fp32":
        raise UsageError("--keep-master params takes the FP32 params as the master: it needs --dtype fp32, "
                         f"got --dtype {args.dtype}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    if resumed and resumed["step"] >= args.steps:
        raise UsageError(f"--resume {args.resume} is at step {resumed['step']}; --steps must be more than that")
    return resumed


def check_batch_size(batch_size: int, world: int) -> None:
    """``UsageError`` unless the global batch splits evenly over ``world`` ranks (every rank
    trains on the same number of rows), naming the nearest sizes that do."""
    if batch_size % world:
        lower, upper = batch_size // world * world, (batch_size // world + 1) * world
        valid = f"--batch-size {lower} or {upper}" if lower else f"--batch-size {upper}"
        raise UsageError(f"--batch-size {batch_size} must be divisible by the number of ranks ({world}): {valid}")


# ---------------------------------------------------------------- resuming
# The flags that define the training. A checkpoint records them (extra["flags"]), and --resume
# takes every one the command line does not give from it: "--resume DIR" alone continues the
# saved run exactly. MODEL_FLAGS fix the model and its optimizer state, so a value other than
# the checkpoint's is a flag error. The others may change on resume -- a longer run, another
# learning rate or seed (the batches after the resumed step then differ), the remainder master
# on or off (the checkpoint holds the FP32 master and loads into either), --moments (it holds
# the moments as FP32 or BF16 and loads into any) -- and take effect; the
# run names them. The world size, --mesh, logging, evaluation and checkpointing are free.
MODEL_FLAGS = ("model", "config", "block_size", "mlp_dims", "dtype", "optimizer")
TRAINING_FLAGS = (*MODEL_FLAGS, "keep_master", "moments", "data", "seed", "batch_size", "steps", "lr", "warmup", "weight_decay",
                  "grad_clip")
DTYPE_FLAG = {str(dtype).removeprefix("torch."): name for name, dtype in DTYPES.items()}  # a manifest's param_dtype


def flag(name: str, value=None) -> str:
    """``"--block-size"`` for ``"block_size"``; with a value, ``"--block-size 32"``."""
    spelled = "--" + name.replace("_", "-")
    return spelled if value is None else f"{spelled} {value}"


def against_checkpoint(name: str, value, saved) -> str:
    """``"--dtype fp16 (checkpoint: bf16)"``."""
    return f"{flag(name, value)} (checkpoint: {'none' if saved is None else saved})"


def default_master(param_dtype: torch.dtype) -> str:
    """The master the main job keeps for ``param_dtype`` params: the FP32 params themselves (an
    FP32 master beside them would be a second copy), else an FP32 master."""
    return "params" if param_dtype == torch.float32 else "fp32"


def keep_master(args) -> str:
    """``--keep-master``, or its default for ``--dtype`` (``default_master``)."""
    return args.keep_master or default_master(DTYPES[args.dtype])


def training_flags(args) -> dict:
    """The training flags of ``args`` as a checkpoint records them: the defaults that depend on
    ``--model`` filled in, None for the other model's flags, ``--data`` as an absolute path, a
    non-finite float as its string (strict JSON: ``--grad-clip inf``)."""
    is_gpt, config = args.model == "gpt", args.config or "nano"
    flags = {name: getattr(args, name) for name in TRAINING_FLAGS}
    flags.update(config=config if is_gpt else None,
                 block_size=(args.block_size or GPT_CONFIGS[config]().block_size) if is_gpt else None,
                 mlp_dims=None if is_gpt else ",".join(d.strip() for d in (args.mlp_dims or MLP_DIMS).split(",")),
                 data=os.path.abspath(args.data) if is_gpt and args.data else None, keep_master=keep_master(args))
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
