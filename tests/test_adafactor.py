"""transforms.adafactor: against torch.optim.Adafactor run live on the same numbers (constant and
scheduled learning rates, matrices of 2 and 3 dims factored, vectors not), its factored state's
size, compiled against eager, no host sync, its arguments' errors, and its state through the
engine (tests/test_transforms_sharded.py checks its updates there)."""
from __future__ import annotations

import optree
import pytest
import torch

import fzero
from fzero import transforms
from helpers import forbid_host_syncs, grads_like, odd_params, run_tx, tree_assert_close

STEPS = 6
SCHEDULE = transforms.warmup_cosine_decay(0.0, 3e-2, 2, STEPS)


def seq(n=STEPS):
    return [grads_like(odd_params(), s) for s in range(n)]


def torch_adafactor(params, grads, lr, **kw):
    """``torch.optim.Adafactor(**kw)`` on the same numbers; a schedule ``lr`` is set on the
    param group before each step (the step index is the count the transform reads)."""
    leaves, spec = optree.tree_flatten(params)
    ps = [torch.nn.Parameter(p.clone()) for p in leaves]
    opt = torch.optim.Adafactor(ps, lr=lr if not callable(lr) else 0.0, **kw)
    for step, g in enumerate(grads):
        if callable(lr):
            opt.param_groups[0]["lr"] = float(lr(torch.tensor(step, dtype=torch.int32)))
        for p, x in zip(ps, spec.flatten_up_to(g)):
            p.grad = x.clone()
        opt.step()
    return spec.unflatten([p.detach() for p in ps])


CASES = [{}, {"beta2_decay": -0.5, "eps": (1e-6, 1e-3), "d": 2.0, "weight_decay": 0.1}]


@pytest.mark.parametrize("lr", [1e-2, SCHEDULE], ids=["constant", "schedule"])
@pytest.mark.parametrize("kw", CASES, ids=["defaults", "other"])
def test_adafactor_is_torch_optim_adafactor(lr, kw):
    params, grads = odd_params(), seq()
    got, _ = run_tx(transforms.adafactor(lr, **kw), params, grads)
    tree_assert_close(got, torch_adafactor(params, grads, lr, **kw), rtol=1e-5, atol=1e-6)


def test_matrices_keep_row_and_column_statistics_only():
    """Per matrix ``4 (R + C)`` bytes (a 3-dim leaf: per matrix of its last two dims); vectors
    keep a full second moment."""
    params = {"m": torch.zeros(300, 200), "t": torch.zeros(4, 30, 20), "v": torch.zeros(50)}
    state = transforms.adafactor().init(params)
    nbytes = {k: sum(x.numel() * x.element_size() for x in optree.tree_leaves(v)) for k, v in state.moments.items()}
    assert nbytes == {"m": 4 * (300 + 200), "t": 4 * 4 * (30 + 20), "v": 4 * 50}


def test_compiled_update_equals_eager_and_makes_no_host_sync():
    params, grads = odd_params(), seq(3)
    tx = transforms.adafactor(SCHEDULE, weight_decay=0.1)
    step = torch.compile(lambda g, s, p: tx.update(g, s, p), fullgraph=True)
    state, p = tx.init(params), params
    with forbid_host_syncs():
        for g in grads:
            updates, state = tx.update(g, state, p)
    want, _ = run_tx(tx, params, grads)
    state, p = tx.init(params), params
    for g in grads:
        updates, state = step(g, state, p)
        p = transforms.apply_updates(p, updates)
    tree_assert_close(p, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make, message", [
    (lambda: transforms.adafactor(lr=-1.0), r"adafactor: lr must be a finite number >= 0, got -1.0"),
    (lambda: transforms.adafactor(beta2_decay=0.5), r"adafactor: beta2_decay must be a finite number <= 0, got 0.5"),
    (lambda: transforms.adafactor(eps=(None, -1.0)), r"adafactor: eps\[1\] must be a finite number >= 0"),
    (lambda: transforms.adafactor(eps=(1e-3,)), r"adafactor: eps must be \(eps1, eps2\)"),
    (lambda: transforms.adafactor(d=0.5), r"adafactor: d must be a finite number >= 1, got 0.5"),
])
def test_bad_arguments_name_the_argument_and_a_valid_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("world_size", [1, 4])
def test_through_the_engine_each_rank_keeps_the_statistics_whole_and_the_vectors_moment_sharded(world_size):
    """Per rank: ``4 (R + C)`` bytes per matrix, whole, and an FP32 second moment of its own
    elements of the vectors only (the matrices' elements keep none)."""
    params = {"m": torch.zeros(300, 200), "t": torch.zeros(4, 30, 20), "v": torch.zeros(50)}
    engine = fzero.zero1(transforms.adafactor(), param_dtype=torch.float32, loss_scale=None, alignment=1,
                         simulate=(world_size - 1, world_size))
    _, state, _ = engine.init(params)
    moments = state.tx_state.moments.inner_states
    assert [tuple(x.shape) for x in optree.tree_leaves(moments["factored"])] == [(300, 1), (1, 200), (4, 30, 1), (4, 1, 20)]
    v0 = engine.layout.global_offsets[engine.layout.paths.index("v")]  # "v"'s elements: [v0, v0 + 50) of all
    mine = sum(max(0, min(g1, v0 + 50) - max(g0, v0)) for g0, g1, _ in engine.layout.owned(world_size - 1))
    assert moments["full"].numel() == mine and 0 < mine <= 50
    assert sum(x.numel() * 4 for x in optree.tree_leaves(moments["factored"])) == 4 * (300 + 200) + 4 * 4 * (30 + 20)


def test_set_hyperparams_checks_its_hyperparameters_as_the_factory_does():
    state = transforms.adafactor().init(odd_params())
    assert float(transforms.set_hyperparams(state, d=2.0).d) == 2.0
    for name, value, message in [("beta2_decay", 0.5, "a finite number <= 0"), ("d", 0.5, "a finite number >= 1"),
                                 ("eps2", -1.0, "a finite number >= 0")]:
        with pytest.raises(ValueError, match=f"{name} must be {message}"):
            transforms.set_hyperparams(state, **{name: value})
