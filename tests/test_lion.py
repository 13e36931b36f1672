"""transforms.lion: against optax.lion run live (JAX on the CPU, the same numbers), float64 math,
through the engine at 1, 2 and 4 ranks against one process fed the mean grads, compiled against
eager, and its arguments' errors."""
from __future__ import annotations

import optree
import pytest
import torch

from fzero import transforms
from helpers import grads_like, matrices, odd_params, optax_run, run_tx, tree_assert_close

STEPS = 6
SCHEDULE = transforms.warmup_cosine_decay(0.0, 3e-3, 2, STEPS)  # lr 0 at the first step: only decay moves


def seq(n=STEPS):
    return [grads_like(odd_params(), s) for s in range(n)]


def float64_lion(params, grads, *, lr, b1, b2, weight_decay, mask):
    """The algorithm in float64 (sign of the float64 interpolation)."""
    p = optree.tree_map(lambda x: x.double(), params)
    m = optree.tree_map(torch.zeros_like, p)
    for step, g in enumerate(grads):
        rate = float(lr(torch.tensor(step, dtype=torch.int32))) if callable(lr) else lr
        g = optree.tree_map(lambda x: x.double(), g)
        u = optree.tree_map(lambda g, m: torch.sign((1 - b1) * g + b1 * m), g, m)
        p = optree.tree_map(lambda p, u, d: p - rate * (u + (weight_decay * p if d else 0)), p, u, mask(params))
        m = optree.tree_map(lambda g, m: (1 - b2) * g + b2 * m, g, m)
    return p, m


CASES = [(0.9, 0.99, 0.0), (0.95, 0.98, 0.5)]  # (b1, b2, weight_decay)


@pytest.mark.parametrize("lr", [1e-3, SCHEDULE], ids=["constant", "schedule"])
@pytest.mark.parametrize("b1, b2, weight_decay", CASES)
def test_lion_is_optax_lion(lr, b1, b2, weight_decay):
    """Params and momentum against optax's, run on the same numbers (skipped without JAX and
    optax: ``pip install -e '.[reference]'``)."""
    params, grads = odd_params(), seq()
    tx = transforms.lion(lr, betas=(b1, b2), weight_decay=weight_decay, weight_decay_mask=matrices)
    got, state = run_tx(tx, params, grads)
    want, want_state = optax_run(lambda optax, lr: optax.lion(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=matrices),
                                 params, grads, lr)
    want_mu = want_state[0].mu
    tree_assert_close(got, want, rtol=1e-6, atol=1e-7)
    tree_assert_close(state[0].mu, want_mu, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("lr", [1e-3, SCHEDULE], ids=["constant", "schedule"])
@pytest.mark.parametrize("b1, b2, weight_decay", CASES)
def test_lion_is_the_algorithm_in_float64(lr, b1, b2, weight_decay):
    params, grads = odd_params(), seq()
    tx = transforms.lion(lr, betas=(b1, b2), weight_decay=weight_decay, weight_decay_mask=matrices)
    got, state = run_tx(tx, params, grads)
    ref, ref_mu = float64_lion(params, grads, lr=lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=matrices)
    tree_assert_close((got, state[0].mu), (ref, ref_mu), rtol=1e-6, atol=1e-7)


def test_every_step_moves_each_element_by_lr_and_bf16_momentum_rounds_only_the_state():
    params, grads = odd_params(), seq(3)
    got, _ = run_tx(transforms.lion(1e-2), params, grads[:1])
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(params)):
        torch.testing.assert_close((a - b).abs(), torch.full_like(a, 1e-2), rtol=1e-5, atol=0)  # |sign| = 1
    _, s32 = run_tx(transforms.lion(1e-2, mu_dtype=torch.float32), params, grads)
    _, s16 = run_tx(transforms.lion(1e-2, mu_dtype=torch.bfloat16), params, grads)
    # BF16 momentum: each step's FP32 moment rounded to BF16 when stored, nothing else
    w2, c2 = torch.tensor(1 - 0.99, dtype=torch.float32), torch.tensor(0.99, dtype=torch.float32)
    want = optree.tree_map(lambda p: torch.zeros_like(p, dtype=torch.bfloat16), params)
    for g in grads:
        want = optree.tree_map(lambda g, m: (w2 * g + c2 * m.float()).bfloat16(), g, want)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(s16[0].mu), optree.tree_leaves(want)))
    assert transforms.get_hyperparams(s16) == transforms.get_hyperparams(s32)


@pytest.mark.parametrize("make, message", [
    (lambda: transforms.lion(betas=(1.0, 0.99)), r"scale_by_lion: b1 must be in \[0, 1\), got 1.0"),
    (lambda: transforms.lion(betas=(0.9, -0.1)), r"scale_by_lion: b2 must be in \[0, 1\), got -0.1"),
    (lambda: transforms.lion(betas=(0.9,)), r"lion: betas must be \(b1, b2\)"),
    (lambda: transforms.lion(lr=-1.0), r"lion: lr must be a finite number >= 0, got -1.0"),
    (lambda: transforms.lion(weight_decay=float("nan")), r"lion: weight_decay must be a finite number >= 0, got nan"),
    (lambda: transforms.lion(mu_dtype=torch.int8), r"scale_by_lion: mu_dtype must be None, torch.float32 or torch.bfloat16"),
])
def test_bad_arguments_name_the_argument_and_a_valid_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()
