"""transforms.schedule_free_adamw: against optax.contrib.schedule_free_adamw run live (JAX on the
CPU, the same numbers) with its evaluation params, float64 math, through the engine (the
evaluation params gathered from every rank: ``engine.params_from``), and its arguments'
errors. The engine at 2 and 4 ranks and on a mesh: tests/test_transforms_sharded.py."""
from __future__ import annotations

import optree
import pytest
import torch

import fzero
from fzero import transforms
from distributed import run_ranks
from helpers import grads_like, matrices, mean_grads, odd_params, optax_run, run_tx, tree_assert_close

STEPS = 6
CASES = [(1e-2, 0, (0.9, 0.999), 0.0, 2.0), (3e-3, 3, (0.95, 0.99), 0.5, 1.0)]  # lr, warmup, betas, wd, power


def seq(n=STEPS):
    return [grads_like(odd_params(), s) for s in range(n)]


def float64_schedule_free(params, grads, *, lr, warmup, betas, weight_decay, power, eps=1e-8):
    """The paper's Schedule-Free AdamW in float64, in optax's arrangement: ``(y, x)`` after the
    steps (the weight reads the warmup at the wrapper's count, from 1; the step at the base's)."""
    b1, b2 = betas
    rate = lambda c: lr * min(c, warmup) / warmup if warmup else lr  # noqa: E731
    y = optree.tree_map(lambda p: p.double(), params)
    z = optree.tree_map(torch.clone, y)
    nu = optree.tree_map(torch.zeros_like, y)
    weight_sum, max_lr = 0.0, 0.0
    for step, g in enumerate(grads):
        t = step + 1
        max_lr = max(max_lr, rate(t))
        weight = max_lr ** power
        weight_sum += weight
        ck = weight / weight_sum if weight_sum else 0.0
        g = optree.tree_map(lambda x: x.double(), g)
        nu = optree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, g)
        dz = optree.tree_map(lambda g, v, y: -rate(step) * (g / ((v / (1 - b2**t)).sqrt() + eps) + weight_decay * y),
                             g, nu, y)
        x = optree.tree_map(lambda y, z: (y - (1 - b1) * z) / b1, y, z)
        z = optree.tree_map(torch.add, z, dz)
        x = optree.tree_map(lambda x, z: (1 - ck) * x + ck * z, x, z)
        y = optree.tree_map(lambda x, z: b1 * x + (1 - b1) * z, x, z)
    return y, optree.tree_map(lambda y, z: (y - (1 - b1) * z) / b1, y, z)


def tx_of(lr, warmup, betas, weight_decay, power, mask=None):
    return transforms.schedule_free_adamw(lr, warmup, betas, weight_decay=weight_decay, weight_lr_power=power,
                                          weight_decay_mask=mask)


@pytest.mark.parametrize("lr, warmup, betas, weight_decay, power", CASES)
def test_schedule_free_adamw_and_its_eval_params_are_optaxs(lr, warmup, betas, weight_decay, power):
    """Params ``y`` and the evaluation params ``x`` against optax's, run on the same numbers
    (skipped without JAX and optax: ``pip install -e '.[reference]'``)."""
    params, grads = odd_params(), seq()
    got, state = run_tx(tx_of(lr, warmup, betas, weight_decay, power), params, grads)

    def make(optax, _):
        return optax.contrib.schedule_free_adamw(lr, warmup_steps=warmup or None, b1=betas[0], b2=betas[1],
                                                 weight_decay=weight_decay, weight_lr_power=power)

    want, want_state = optax_run(make, params, grads, lr)
    tree_assert_close(got, want, rtol=1e-6, atol=1e-7)
    x = transforms.schedule_free_eval_params(state, got)
    want_x = optree.tree_map(lambda y, z: (y - (1 - betas[0]) * z) / betas[0], want, want_state.z)
    tree_assert_close(x, want_x, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("lr, warmup, betas, weight_decay, power", CASES)
def test_schedule_free_adamw_is_the_algorithm_in_float64(lr, warmup, betas, weight_decay, power):
    params, grads = odd_params(), seq()
    got, state = run_tx(tx_of(lr, warmup, betas, weight_decay, power), params, grads)
    y, x = float64_schedule_free(params, grads, lr=lr, warmup=warmup, betas=betas, weight_decay=weight_decay,
                                 power=power)
    tree_assert_close(got, y, rtol=1e-5, atol=1e-7)
    tree_assert_close(transforms.schedule_free_eval_params(state, got), x, rtol=1e-5, atol=1e-7)


def test_a_decay_mask_decays_only_the_masked_leaves_and_hyperparams_read_the_base_step():
    """With zero grads from the start the moment-free step is the decay alone: the masked
    leaves (matrices) shrink, the others stay; ``get_hyperparams`` gives the learning rate of the
    base step (a warmup's at the base's count)."""
    params = odd_params()
    zeros = [optree.tree_map(torch.zeros_like, params)] * 3
    tx = transforms.schedule_free_adamw(1e-1, 2, weight_decay=0.5, weight_decay_mask=matrices)
    got, state = run_tx(tx, params, zeros)
    for p, q in zip(optree.tree_leaves(params), optree.tree_leaves(got)):
        if p.ndim > 1:
            assert q.norm() < 0.99 * p.norm()
        else:  # x = (y - (1 - b1) z) / b1 with z = y: y again, to a rounding
            torch.testing.assert_close(q, p, rtol=1e-6, atol=0)
    assert float(transforms.get_hyperparams(state, tx)["lr"]) == pytest.approx(1e-1)  # count 3: past the warmup
    assert transforms.get_hyperparams(state)["b1"] == 0.9


@pytest.mark.parametrize("make, message", [
    (lambda: transforms.schedule_free_adamw(betas=(0.0, 0.999)), r"betas\[0\] must be in \(0, 1\)"),
    (lambda: transforms.schedule_free_adamw(betas=(0.9, 1.0)), r"betas\[1\] must be in \[0, 1\), got 1.0"),
    (lambda: transforms.schedule_free_adamw(warmup_steps=-1), r"warmup_steps"),
    (lambda: transforms.schedule_free_adamw(lr=-1.0), r"lr must be a finite number >= 0, got -1.0"),
    (lambda: transforms.schedule_free_adamw(weight_lr_power=float("inf")), r"weight_lr_power must be a finite number"),
])
def test_bad_arguments_name_the_argument_and_a_valid_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def eval_params_of_ranks(rank, world_size):
    """STEPS steps through the engine (16-element buckets: shards cut leaves), then the
    evaluation params gathered from every rank, on each rank."""
    p0 = odd_params()
    engine = fzero.zero1(tx_of(*CASES[1], mask=matrices), param_dtype=torch.float32, loss_scale=None, bucket_bytes=64)
    params, state, ss = engine.init(p0)
    for step in range(STEPS):
        params, state, ss, _ = engine.step(params, grads_like(p0, 10 * step + rank), state, ss)
    return {"params": params, "eval": engine.params_from(params, state, transforms.schedule_free_eval_params)}


@pytest.mark.multirank
def test_through_the_engine_the_eval_params_gathered_from_every_rank_are_one_processs():
    """At 2 ranks the params and the gathered evaluation params equal the transform's in one
    process fed the mean grads, on every rank."""
    out = run_ranks(eval_params_of_ranks, 2)
    p0 = odd_params()
    tx = tx_of(*CASES[1], mask=matrices)
    want, state = run_tx(tx, p0, [mean_grads(lambda r: grads_like(p0, 10 * s + r), 2) for s in range(STEPS)])
    want_x = transforms.schedule_free_eval_params(state, want)
    for r in out:
        tree_assert_close(r["params"], want, rtol=1e-6, atol=1e-7)
        tree_assert_close(r["eval"], want_x, rtol=1e-5, atol=1e-7)


def test_params_from_a_state_without_schedule_free_says_so():
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float32)
    params, state, _ = engine.init(odd_params())
    with pytest.raises(ValueError, match="holds 0 ScheduleFreeState"):
        engine.params_from(params, state, transforms.schedule_free_eval_params)


def test_a_constant_learning_rate_set_between_steps_moves_the_step_and_the_averaging_weight():
    """``set_hyperparams(lr=)`` on a constant rate: the next step is the one a transform built
    with that rate takes from the same state (the base's step and the averaging weight both read
    it)."""
    params, grads = odd_params(), seq(3)
    p, state = run_tx(tx_of(1e-2, 0, (0.9, 0.999), 0.0, 2.0), params, grads[:2])
    moved, _ = tx_of(1e-2, 0, (0.9, 0.999), 0.0, 2.0).update(grads[2], transforms.set_hyperparams(state, lr=3e-2), p)
    want, _ = tx_of(3e-2, 0, (0.9, 0.999), 0.0, 2.0).update(grads[2], transforms.set_hyperparams(state, lr=3e-2), p)
    tree_assert_close(moved, want, rtol=0, atol=0)
    unchanged, _ = tx_of(1e-2, 0, (0.9, 0.999), 0.0, 2.0).update(grads[2], state, p)
    assert not all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(moved), optree.tree_leaves(unchanged)))


@pytest.mark.parametrize("b1", [0.0, 1.0])
def test_set_hyperparams_checks_b1_as_the_factory_does(b1):
    """``b1`` in (0, 1), not the [0, 1) of Adam's betas: the evaluation params divide by it."""
    state = tx_of(1e-2, 0, (0.9, 0.999), 0.0, 2.0).init(odd_params())
    with pytest.raises(ValueError, match=r"b1 must be in \(0, 1\): x is \(y - \(1 - b1\) z\) / b1"):
        transforms.set_hyperparams(state, b1=b1)
    with pytest.raises(ValueError, match=r"schedule_free_adamw: betas\[0\] must be in \(0, 1\)"):
        transforms.schedule_free_adamw(1e-2, betas=(b1, 0.999))
    assert float(dict(transforms.iter_hyperparams(transforms.set_hyperparams(state, b1=0.5)))["b1"]) == 0.5
