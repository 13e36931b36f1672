"""transforms.lamb: against optax.lamb run live (JAX on the CPU, the same numbers), float64 math,
through the engine at 1, 2 and 4 ranks (shards cutting leaves: each leaf's norms summed over the
ranks holding it) and on a 2x2 mesh against one process fed the mean grads, compiled against
eager, the collective it adds to a step, and its arguments' errors."""
from __future__ import annotations

import optree
import pytest
import torch

import fzero
from fzero import transforms
from distributed import run_ranks
from helpers import counting_comm, grads_like, matrices, odd_params, optax_run, run_tx, tree_assert_close

STEPS = 6
SCHEDULE = transforms.warmup_cosine_decay(0.0, 3e-3, 2, STEPS)  # lr 0 at the first step: only the state moves
CASES = [((0.9, 0.999), 1e-6, 0.0), ((0.8, 0.99), 1e-4, 0.5)]  # (betas, eps, weight_decay)


def seq(n=STEPS):
    return [grads_like(odd_params(), s) for s in range(n)]


def float64_lamb(params, grads, *, lr, betas, eps, weight_decay, mask):
    """The paper's Algorithm 2 (optax's arrangement: eps outside the square root, the decay
    added before the trust ratio) in float64."""
    b1, b2 = betas
    p = optree.tree_map(lambda x: x.double(), params)
    m, v = (optree.tree_map(torch.zeros_like, p) for _ in range(2))
    for step, g in enumerate(grads):
        t = step + 1
        rate = float(lr(torch.tensor(step, dtype=torch.int32))) if callable(lr) else lr
        g = optree.tree_map(lambda x: x.double(), g)
        m = optree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = optree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        r = optree.tree_map(lambda m, v, p, d: (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
                            + (weight_decay * p if d else 0), m, v, p, mask(params))
        ratio = lambda p, r: 1.0 if p.norm() == 0 or r.norm() == 0 else p.norm() / r.norm()  # noqa: E731
        p = optree.tree_map(lambda p, r: p - rate * ratio(p, r) * r, p, r)
    return p


def zero_leaf_params():
    """``odd_params`` with one leaf at zero: its trust ratio is 1 (optax's rule)."""
    p = odd_params()
    p["blocks"][0]["g"] = torch.zeros_like(p["blocks"][0]["g"])
    return p


@pytest.mark.parametrize("lr", [1e-3, SCHEDULE], ids=["constant", "schedule"])
@pytest.mark.parametrize("betas, eps, weight_decay", CASES)
def test_lamb_is_optax_lamb(lr, betas, eps, weight_decay):
    """Params and moments against optax's, run on the same numbers, a leaf at zero among them
    (skipped without JAX and optax: ``pip install -e '.[reference]'``)."""
    params, grads = zero_leaf_params(), seq()
    tx = transforms.lamb(lr, betas=betas, eps=eps, weight_decay=weight_decay, weight_decay_mask=matrices)
    got, state = run_tx(tx, params, grads)
    want, want_state = optax_run(lambda optax, lr: optax.lamb(lr, b1=betas[0], b2=betas[1], eps=eps,
                                                              weight_decay=weight_decay, mask=matrices), params, grads, lr)
    tree_assert_close(got, want, rtol=1e-6, atol=1e-7)
    # the first moment as torch.optim forms it, m + (1 - b1)(g - m), optax as (1 - b1) g + b1 m: a rounding apart
    tree_assert_close((state[0].mu, state[0].nu), (want_state[0].mu, want_state[0].nu), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("lr", [1e-3, SCHEDULE], ids=["constant", "schedule"])
@pytest.mark.parametrize("betas, eps, weight_decay", CASES)
def test_lamb_is_the_algorithm_in_float64(lr, betas, eps, weight_decay):
    params, grads = zero_leaf_params(), seq()
    tx = transforms.lamb(lr, betas=betas, eps=eps, weight_decay=weight_decay, weight_decay_mask=matrices)
    got, _ = run_tx(tx, params, grads)
    ref = float64_lamb(params, grads, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, mask=matrices)
    tree_assert_close(got, ref, rtol=1e-6, atol=1e-8)


def test_each_leaf_moves_by_lr_times_its_norm_at_the_first_step():
    """The trust ratio rescales each leaf's step to ``lr * ||p||`` (the ratio's point: a step
    relative to the weights); a leaf at zero moves by Adam's step, ratio 1."""
    params, grads = zero_leaf_params(), seq(1)
    got, _ = run_tx(transforms.lamb(1e-2), params, grads)
    for p, q in zip(optree.tree_leaves(params), optree.tree_leaves(got)):
        step = (q - p).norm()
        if p.norm() > 0:
            torch.testing.assert_close(step, 1e-2 * p.norm(), rtol=1e-5, atol=0)
        else:  # Adam's first step is +-lr per element (to eps)
            torch.testing.assert_close(step, torch.tensor(1e-2 * p.numel() ** 0.5), rtol=1e-4, atol=0)


@pytest.mark.parametrize("make, message", [
    (lambda: transforms.lamb(betas=(1.0, 0.999)), r"lamb: betas\[0\] must be in \[0, 1\), got 1.0"),
    (lambda: transforms.lamb(betas=(0.9,)), r"lamb: betas must be \(b1, b2\)"),
    (lambda: transforms.lamb(eps=-1.0), r"lamb: eps must be a finite number >= 0, got -1.0"),
    (lambda: transforms.lamb(lr=float("nan")), r"lamb: lr must be a finite number >= 0, got nan"),
    (lambda: transforms.lamb(weight_decay=-0.1), r"lamb: weight_decay must be a finite number >= 0"),
])
def test_bad_arguments_name_the_argument_and_a_valid_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_without_params_it_says_it_needs_them():
    tx = transforms.scale_by_trust_ratio()
    with pytest.raises(ValueError, match="scale_by_trust_ratio needs params"):
        tx.update(odd_params(), tx.init(odd_params()))


def collectives_of_a_step(rank, world_size):
    """The collectives one eager step issues, with AdamW and with LAMB (16-element buckets)."""
    out = {}
    for name, tx in (("adamw", transforms.adamw(1e-3)), ("lamb", transforms.lamb(1e-3))):
        calls = []
        engine = fzero.zero1(tx, param_dtype=torch.float32, loss_scale=None, bucket_bytes=64, group=counting_comm(calls))
        params, state, ss = engine.init(odd_params())
        calls.clear()
        engine.step(params, grads_like(odd_params(), rank), state, ss)
        out[name] = list(calls)
    return out


@pytest.mark.multirank
def test_a_step_adds_one_all_reduce_of_two_fp32_values_per_leaf():
    """LAMB's step issues AdamW's collectives and one all-reduce more: two FP32 sums of squares
    (params, updates) per leaf, 8 bytes a leaf (odd_params: 4 leaves)."""
    out = run_ranks(collectives_of_a_step, 2)
    for r in out:
        extra = list(r["lamb"])
        for call in r["adamw"]:
            extra.remove(call)
        assert extra == [("all_reduce", 2 * 4 * 4)], r
