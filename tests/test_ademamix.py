"""transforms.ademamix: against optax.contrib.ademamix run live (JAX on the CPU, the same
numbers), float64 math, through the engine at 1, 2 and 4 ranks and on a 2x2 mesh against one
process fed the mean grads, compiled against eager, and its arguments' errors."""
from __future__ import annotations

import optree
import pytest
import torch

from fzero import transforms
from helpers import grads_like, matrices, odd_params, optax_run, run_tx, tree_assert_close

STEPS = 6
SCHEDULE = transforms.warmup_cosine_decay(0.0, 3e-3, 2, STEPS)  # lr 0 at the first step: only the state moves
CASES = [((0.9, 0.999, 0.9999), 5.0, 0.0), ((0.8, 0.99, 0.95), 2.0, 0.5)]  # (betas, alpha, weight_decay)


def seq(n=STEPS):
    return [grads_like(odd_params(), s) for s in range(n)]


def float64_ademamix(params, grads, *, lr, betas, alpha, weight_decay, mask, eps=1e-8):
    """The paper's Algorithm 1 in float64 (constant alpha and b3)."""
    b1, b2, b3 = betas
    p = optree.tree_map(lambda x: x.double(), params)
    m1, m2, nu = (optree.tree_map(torch.zeros_like, p) for _ in range(3))
    for step, g in enumerate(grads):
        t = step + 1
        rate = float(lr(torch.tensor(step, dtype=torch.int32))) if callable(lr) else lr
        g = optree.tree_map(lambda x: x.double(), g)
        m1 = optree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m1, g)
        m2 = optree.tree_map(lambda m, g: b3 * m + (1 - b3) * g, m2, g)
        nu = optree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, g)
        u = optree.tree_map(lambda a, b, v: (a / (1 - b1**t) + alpha * b) / ((v / (1 - b2**t)).sqrt() + eps), m1, m2, nu)
        p = optree.tree_map(lambda p, u, d: p - rate * (u + (weight_decay * p if d else 0)), p, u, mask(params))
    return p, (m1, m2, nu)


@pytest.mark.parametrize("lr", [1e-3, SCHEDULE], ids=["constant", "schedule"])
@pytest.mark.parametrize("betas, alpha, weight_decay", CASES)
def test_ademamix_is_optax_contrib_ademamix(lr, betas, alpha, weight_decay):
    """Params and the three moments against optax's, run on the same numbers (skipped without
    JAX and optax: ``pip install -e '.[reference]'``)."""
    params, grads = odd_params(), seq()
    tx = transforms.ademamix(lr, betas=betas, alpha=alpha, weight_decay=weight_decay, weight_decay_mask=matrices)
    got, state = run_tx(tx, params, grads)
    b1, b2, b3 = betas
    want, want_state = optax_run(lambda optax, lr: optax.contrib.ademamix(
        lr, b1=b1, b2=b2, b3=b3, alpha=alpha, weight_decay=weight_decay, mask=matrices), params, grads, lr)
    want_state = (want_state[0].m1, want_state[0].m2, want_state[0].nu)
    tree_assert_close(got, want, rtol=1e-6, atol=1e-7)
    tree_assert_close((state[0].m1, state[0].m2, state[0].nu), want_state, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("lr", [1e-3, SCHEDULE], ids=["constant", "schedule"])
@pytest.mark.parametrize("betas, alpha, weight_decay", CASES)
def test_ademamix_is_the_algorithm_in_float64(lr, betas, alpha, weight_decay):
    params, grads = odd_params(), seq()
    tx = transforms.ademamix(lr, betas=betas, alpha=alpha, weight_decay=weight_decay, weight_decay_mask=matrices)
    got, state = run_tx(tx, params, grads)
    ref, ref_state = float64_ademamix(params, grads, lr=lr, betas=betas, alpha=alpha, weight_decay=weight_decay,
                                      mask=matrices)
    tree_assert_close((got, state[0].m1, state[0].m2, state[0].nu), (ref, *ref_state), rtol=1e-6, atol=1e-8)


def test_alpha_zero_and_b3_zero_are_adam_and_hyperparams_are_set_between_steps():
    """``alpha=0`` drops the slow momentum: the updates are AdamW's (torch.optim's arrangement,
    to rounding); ``set_hyperparams`` changes ``alpha`` and ``b3`` of a state in place of new
    transforms, and a bad value names the argument."""
    params, grads = odd_params(), seq()
    got, state = run_tx(transforms.ademamix(1e-2, alpha=0.0), params, grads)
    want, _ = run_tx(transforms.adamw(1e-2, weight_decay=0.0), params, grads)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    state = transforms.set_hyperparams(state, alpha=3.0, b3=0.5)
    assert transforms.get_hyperparams(state)["alpha"] == 3.0 and transforms.get_hyperparams(state)["b3"] == 0.5
    with pytest.raises(ValueError, match=r"b3 must be in \[0, 1\), got 1.5"):
        transforms.set_hyperparams(state, b3=1.5)


@pytest.mark.parametrize("make, message", [
    (lambda: transforms.ademamix(betas=(1.0, 0.999, 0.9999)), r"scale_by_ademamix: b1 must be in \[0, 1\), got 1.0"),
    (lambda: transforms.ademamix(betas=(0.9, 0.999, 1.0)), r"scale_by_ademamix: b3 must be in \[0, 1\), got 1.0"),
    (lambda: transforms.ademamix(betas=(0.9, 0.999)), r"ademamix: betas must be \(b1, b2, b3\)"),
    (lambda: transforms.ademamix(alpha=-1.0), r"scale_by_ademamix: alpha must be a finite number >= 0, got -1.0"),
    (lambda: transforms.ademamix(lr=float("inf")), r"ademamix: lr must be a finite number >= 0, got inf"),
    (lambda: transforms.ademamix(weight_decay=-0.1), r"ademamix: weight_decay must be a finite number >= 0"),
])
def test_bad_arguments_name_the_argument_and_a_valid_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()
