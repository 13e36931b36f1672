"""What the main job (examples/train.py) trains and how: its data and model, the optimizer
(clipping, AdamW with decay on the matrices), the learning-rate schedule, the device mesh of
``--mesh``, and the train step and evaluation the loop calls."""
from __future__ import annotations

import dataclasses
import functools
import math

import optree
import torch
from torch.distributed.device_mesh import init_device_mesh

import fzero
from fzero import transforms
from data import CharCorpus, TeacherRegression
from flags import GPT_CONFIGS, MOMENTS, UsageError
from fzero.models import gpt, mlp
from ranks import mean_over_ranks


# ---------------------------------------------------------------- data and model
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


def build(args, data, device):
    """``(params_fp32, loss_fn, items per sequence)`` for ``--model``, on ``data``."""
    seed = torch.Generator().manual_seed(args.seed)
    if args.model == "gpt":
        config = GPT_CONFIGS[args.config]()
        config = dataclasses.replace(config, vocab_size=data.vocab_size, block_size=data.block_size)
        return gpt.init(seed, config, device=device), functools.partial(gpt.loss, config=config), data.block_size
    dims = tuple(int(d) for d in args.mlp_dims.split(","))
    return mlp.init(seed, dims, device=device), mlp.loss, 1


# ---------------------------------------------------------------- the optimizer and the mesh
def decays(params):
    """Which leaves get weight decay: matrices (weights, embeddings), not biases or norm
    gains -- nanoGPT's rule, ``ndim >= 2``."""
    return optree.tree_map(lambda x: x.ndim >= 2, params)


def lr_schedule(args):
    """Warmup from 0 to --lr over --warmup steps, then cosine to --lr/10 at --steps: a function
    of the count of applied updates (a 0-d tensor). ``--optimizer schedule_free``: the warmup,
    then --lr to the end (its averaging stands for the decay: the method's point)."""
    warmup = min(args.warmup, args.steps - 1)  # the decay needs at least one step
    if args.optimizer == "schedule_free":
        return transforms.linear_warmup(0.0, args.lr, warmup) if warmup else transforms.constant(args.lr)
    return transforms.warmup_cosine_decay(0.0, args.lr, warmup, args.steps, end_value=args.lr / 10)


def schedule_count(state) -> torch.Tensor:
    """The count the learning-rate schedule reads, from the optimizer state (a 0-d tensor)."""
    is_sched = lambda x: isinstance(x, transforms.scale.ScaleByScheduleState)  # noqa: E731
    return next(x.count for x in optree.tree_leaves(state.tx_state, is_leaf=is_sched) if is_sched(x))


def make_optimizer(args) -> transforms.GradientTransformation:
    """Clip by the global grad norm (over all ranks), then AdamW with a warmup-cosine learning
    rate (``lr_schedule``) and decoupled weight decay on the matrices only (``decays``), its
    moments stored as ``--moments`` says. ``--optimizer muon``: Muon on the blocks' weight
    matrices instead (``gpt.muon_labels``), with the same schedule and weight decay, its update
    scaled to AdamW's RMS (``adjust_lr_fn="match_rms_adamw"``, Moonshot's: AdamW's learning rate
    carries over), and AdamW on the rest. ``--optimizer lion``: Lion on every param, with the same
    schedule, weight decay and mask, its momentum stored as ``--moments`` says. ``--optimizer
    ademamix``: AdEMAMix on every param, the same schedule, weight decay and mask, AdamW's betas
    and a slow momentum of ``b3 = 0.999`` weighed by ``alpha = 5`` (a shorter memory than optax's
    0.9999, which the paper advises for runs of a few thousand steps). ``--optimizer lamb``: LAMB on
    every param (AdamW's betas, eps 1e-6), the same schedule, weight decay and mask: each param's
    step is the learning rate times its norm. ``--optimizer schedule_free``: Schedule-Free AdamW
    (``b1 = 0.9`` its interpolation, AdamW's ``b2``) with the warmup and no decay
    (``lr_schedule``), the same weight decay and mask; evaluate its averaged params
    (``eval_params``). ``--optimizer adafactor``: Adafactor (torch's defaults: factored second
    moment, relative step ``max(1e-3, RMS(p)) * min(lr, 1/sqrt(t))``, update clipping) on every
    param, the same schedule, the weight decay on the masked leaves only (torch's Adafactor has
    no mask: two groups)."""
    lr = lr_schedule(args)
    clip = [] if math.isinf(args.grad_clip) else [transforms.clip_by_global_norm(args.grad_clip)]
    moments = MOMENTS[args.moments]
    decay = {"weight_decay": args.weight_decay, "weight_decay_mask": decays}
    adamw = lambda: transforms.adamw(lr=lr, betas=(0.9, 0.99), mu_dtype=moments, nu_dtype=moments, **decay)  # noqa: E731
    optimizers = {
        "adamw": adamw,
        "lion": lambda: transforms.lion(lr=lr, betas=(0.9, 0.99), mu_dtype=moments, **decay),
        "ademamix": lambda: transforms.ademamix(lr=lr, betas=(0.9, 0.99, 0.999), alpha=5.0, **decay),
        "schedule_free": lambda: transforms.schedule_free_adamw(lr, betas=(0.9, 0.99), **decay),
        "lamb": lambda: transforms.lamb(lr=lr, betas=(0.9, 0.99), **decay),
        # torch.optim.Adafactor has no mask: the decayed leaves are a group of their own
        "adafactor": lambda: transforms.partition(
            {"decay": transforms.adafactor(lr, weight_decay=args.weight_decay), "rest": transforms.adafactor(lr)},
            lambda p: optree.tree_map(lambda d: "decay" if d else "rest", decays(p))),
        "muon": lambda: transforms.partition(
            {"muon": transforms.muon(lr=lr, weight_decay=args.weight_decay, adjust_lr_fn="match_rms_adamw"), "adamw": adamw()},
            gpt.muon_labels),
    }
    return transforms.chain(*clip, optimizers[args.optimizer]())


def make_mesh(spec, device: torch.device):
    """The ``("replicate", "shard")`` device mesh of ``--mesh R,S`` (``None`` without it)."""
    return None if spec is None else init_device_mesh(device.type, spec, mesh_dim_names=("replicate", "shard"))


# ---------------------------------------------------------------- the step
def make_train_step(engine, loss_fn, *, compile: bool, keep_grads: bool = True):
    """``train_step(params, state, scaler_state, batch) -> (params, state, scaler_state, loss,
    info)``: one optimizer step with no host sync. ``loss`` is this rank's unscaled loss and
    ``info`` the engine's, 0-d tensors on the device.

    Which grads, chosen once here:

    * ``compile`` with one bucket (train.py's default): the loss is a compiled function of the
      flat param buffer (``engine.flat_params``; the leaves are views of it, ``fzero.unflatten``),
      so its compiled backward writes the grads straight into one flat buffer, laid out for
      ``engine.step``, which reduce-scatters it: the same buffer every step (``grads_into``;
      ``keep_grads=False``: a new one from each backward, ``flat.grad``, as
      ``benchmarks/e2e.py --variants new-grads`` measures it). One bucket has nothing to
      overlap with backward.
    * Several buckets (``--bucket-mb``), or not ``compile``: ``engine.grad_and_value``, each
      bucket's reduce-scatter started inside backward while backward goes on (eager only).

    ``engine.step`` runs on the flat buffer, compiled with ``compile``. The learning rate and the
    loss scale are tensors in the state, so changing them never recompiles anything. Why this
    and not the whole step in one graph: measured side by side against the torch recipe in
    docs/performance.md ("The main job against the torch recipe")."""
    optimizer_step = torch.compile(engine.step, fullgraph=True) if compile else engine.step
    if not compile or len(engine.layout.buckets) > 1:
        return overlapped_train_step(engine, loss_fn, optimizer_step)

    # ``like``: the params pytree, whose structure dynamo can rebuild (fzero.unflatten)
    loss_of_flat = torch.compile(lambda flat, grads, batch, like: loss_fn(
        fzero.unflatten(flat, engine.layout, like=like, grads_into=grads), batch))
    grads_buffer: list[torch.Tensor] = []  # the flat grads, allocated at the first step

    def train_step(params, state, scaler_state, batch):
        flat = engine.flat_params(params)
        if keep_grads and not grads_buffer:
            grads_buffer.append(torch.zeros_like(flat))
        grads = grads_buffer[0] if keep_grads else None
        leaf = flat.detach().requires_grad_()  # an autograd leaf aliasing the buffer: no copy
        loss = loss_of_flat(leaf, grads, batch, params)
        fzero.scale_loss(loss, scaler_state).backward()  # writes every element of ``grads``
        # The step on the flat buffer: compiled, it writes the new params in the update's own
        # pass, and the grads are already the flat buffer backward wrote (docs/performance.md).
        flat, state, scaler_state, info = optimizer_step(flat, leaf.grad if grads is None else grads, state,
                                                         scaler_state)
        return fzero.unflatten(flat, engine.layout), state, scaler_state, loss.detach(), info

    return train_step


def overlapped_train_step(engine, loss_fn, optimizer_step):
    """``make_train_step``'s step with the grads of ``engine.grad_and_value`` (each bucket's
    reduce-scatter started inside eager backward) and ``optimizer_step`` (``engine.step``,
    compiled or not) on the flat buffer."""
    grad_fn = engine.grad_and_value(loss_fn)

    def train_step(params, state, scaler_state, batch):
        grads, loss = grad_fn(params, scaler_state, batch)
        flat, state, scaler_state, info = optimizer_step(engine.flat_params(params), grads, state, scaler_state)
        return fzero.unflatten(flat, engine.layout), state, scaler_state, loss, info

    return train_step


@torch.no_grad()
def eval_params(engine, args):
    """``(params, state) -> the params to evaluate``, chosen once: the trained params, or with
    ``--optimizer schedule_free`` its averaged sequence ``x``, which it is meant to be evaluated
    and exported at (``engine.params_from``: gathered from every rank, a new buffer)."""
    if args.optimizer == "schedule_free":
        return lambda params, state: engine.params_from(params, state, transforms.schedule_free_eval_params)
    return lambda params, state: params


def evaluate(params, loss_fn, batches) -> float:
    """Mean loss over ``batches`` (this rank's rows), averaged over ranks."""
    return mean_over_ranks(torch.stack([loss_fn(params, b) for b in batches]).mean()).item()
