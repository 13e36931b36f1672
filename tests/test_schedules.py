import math
import re

import optree
import pytest
import torch

import fzero
from fzero import transforms
from helpers import forbid_host_syncs, grads_like, odd_params


def values(schedule, n):
    return [float(schedule(torch.tensor(t, dtype=torch.int32))) for t in range(n)]


def test_constant_and_linear_warmup():
    assert values(transforms.constant(0.3), 3) == [0.3, 0.3, 0.3]
    got = values(transforms.linear_warmup(0.0, 1.0, 4), 7)
    assert got == pytest.approx([0, 0.25, 0.5, 0.75, 1, 1, 1])


def test_cosine_decay_closed_form():
    s = transforms.cosine_decay(2.0, 10, end_value=0.2)
    for t, v in enumerate(values(s, 14)):
        want = 0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * min(t, 10) / 10))
        assert v == pytest.approx(want, rel=1e-12)


def test_warmup_cosine_decay_closed_form():
    s = transforms.warmup_cosine_decay(0.0, 1.0, warmup_steps=5, decay_steps=25, end_value=0.1)
    for t, v in enumerate(values(s, 30)):
        if t < 5:
            want = t / 5
        else:
            want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t - 5, 20) / 20))
        assert v == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert float(s(5)) == pytest.approx(1.0)  # Python ints work too
    with pytest.raises(ValueError):
        transforms.warmup_cosine_decay(0, 1, 10, 10)


def test_adamw_follows_schedule_by_applied_count():
    sched = transforms.linear_warmup(0.0, 1.0, 4)
    tx = transforms.chain(transforms.scale_by_learning_rate(sched))
    g = torch.ones(3)
    state = tx.init(g)
    seen = []
    for _ in range(6):
        u, state = tx.update(g, state)
        seen.append(-float(u[0]))
    assert seen == pytest.approx([0, 0.25, 0.5, 0.75, 1, 1])


@pytest.mark.parametrize(
    "schedule, held",
    [
        (lambda: transforms.linear(1.0, 0.0, 0), 1.0),
        (lambda: transforms.linear(0.25, 3.0, 0), 0.25),
        (lambda: transforms.linear_warmup(0.5, 1.0, 0), 0.5),
        (lambda: transforms.linear_warmup(0.0, 1.0, 0), 0.0),  # optax: held at init_value forever
    ],
)
def test_zero_transition_steps_hold_init_value(schedule, held):
    s = schedule()
    assert values(s, 5) == [held] * 5
    assert float(s(10**6)) == held
    assert s(torch.tensor(3, dtype=torch.int32)).dtype == torch.float64


def test_warmup_cosine_decay_without_warmup_starts_at_peak():
    s = transforms.warmup_cosine_decay(0.0, 1.0, warmup_steps=0, decay_steps=10, end_value=0.1)
    ref = transforms.cosine_decay(1.0, 10, end_value=0.1)
    assert values(s, 14) == pytest.approx(values(ref, 14), rel=1e-12)
    assert values(s, 1) == [1.0]


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: transforms.linear(0.0, 1.0, -1), "linear: transition_steps must be an integer >= 0, got -1"),
        (lambda: transforms.linear(0.0, 1.0, 2.5), "linear: transition_steps must be an integer >= 0, got 2.5"),
        (lambda: transforms.linear(0.0, 1.0, True), "linear: transition_steps must be an integer >= 0, got True"),
        (lambda: transforms.linear(INF, 1.0, 5), "linear: init_value must be a finite number, got inf"),
        (lambda: transforms.linear(0.0, NAN, 5), "linear: end_value must be a finite number, got nan"),
        (lambda: transforms.linear_warmup(0.0, 1.0, -3), "linear_warmup: warmup_steps must be an integer >= 0, got -3"),
        (lambda: transforms.linear_warmup(0.0, INF, 3), "linear_warmup: peak_value must be a finite number, got inf"),
        (lambda: transforms.constant(NAN), "constant: value must be a finite number, got nan"),
        (lambda: transforms.cosine_decay(1.0, 0), "cosine_decay: decay_steps must be an integer >= 1, got 0"),
        (lambda: transforms.cosine_decay(1.0, -5), "cosine_decay: decay_steps must be an integer >= 1, got -5"),
        (lambda: transforms.cosine_decay(1.0, 10.5), "cosine_decay: decay_steps must be an integer >= 1, got 10.5"),
        (lambda: transforms.cosine_decay(NAN, 10), "cosine_decay: init_value must be a finite number, got nan"),
        (lambda: transforms.cosine_decay(1.0, 10, end_value=-INF), "cosine_decay: end_value must be a finite number, got -inf"),
        (lambda: transforms.warmup_cosine_decay(0.0, 1.0, -1, 10), "warmup_cosine_decay: warmup_steps must be an integer >= 0, got -1"),
        (lambda: transforms.warmup_cosine_decay(0.0, 1.0, 2.5, 10), "warmup_cosine_decay: warmup_steps must be an integer >= 0, got 2.5"),
        (lambda: transforms.warmup_cosine_decay(0.0, 1.0, 2, 10.0), "warmup_cosine_decay: decay_steps must be an integer >= 1, got 10.0"),
        (lambda: transforms.warmup_cosine_decay(0.0, 1.0, 10, 10), "warmup_cosine_decay: decay_steps (10) must exceed warmup_steps (10)"),
        (lambda: transforms.warmup_cosine_decay(NAN, 1.0, 2, 10), "warmup_cosine_decay: init_value must be a finite number, got nan"),
        (lambda: transforms.warmup_cosine_decay(0.0, INF, 2, 10), "warmup_cosine_decay: peak_value must be a finite number, got inf"),
        (lambda: transforms.warmup_cosine_decay(0.0, 1.0, 2, 10, end_value=NAN), "warmup_cosine_decay: end_value must be a finite number, got nan"),
    ],
)
def test_invalid_schedule_arguments_raise(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_integer_like_step_counts_are_accepted():
    s = transforms.warmup_cosine_decay(0.0, 1.0, torch.tensor(2), torch.tensor(6))
    assert values(s, 3) == pytest.approx([0.0, 0.5, 1.0])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "generic"])
def test_get_hyperparams_shows_the_scheduled_lr_the_next_step_applies(fused):
    """``get_hyperparams`` had no ``lr`` when the lr was a schedule. Given the transform, it shows ``schedule(count)``
    at the state's count of applied updates: the lr the next step applies and reports as
    ``info["lr"]`` (torch's ``get_last_lr``), computed without a host sync, next to the stored
    hyperparameters; a skipped step leaves it where it was."""
    sched = transforms.warmup_cosine_decay(1e-3, 1e-2, 2, 6, end_value=1e-4)
    tx = transforms.adamw(lr=sched, weight_decay=0.1)
    tx = tx if fused else tx._replace(fused=None)
    engine = fzero.zero1(tx, param_dtype=torch.float16, loss_scale=fzero.StaticLossScale(4.0))
    p0 = odd_params()
    params, state, ss = engine.init(p0)
    applied = 0
    for i in range(7):
        grads = optree.tree_map(lambda g: (4 * g).half(), grads_like(p0, i))
        if i == 3:
            grads["w"][0, 0] = float("inf")
        with forbid_host_syncs():
            shown = transforms.get_hyperparams(state.tx_state, tx)
        assert set(shown) == {"b1", "b2", "eps", "weight_decay", "lr"}
        assert "lr" not in transforms.get_hyperparams(state.tx_state)  # stored: the count, not the lr
        assert shown["lr"].ndim == 0 and torch.equal(shown["lr"], sched(torch.tensor(applied, dtype=torch.int32)))
        params, state, ss, info = engine.step(params, grads, state, ss)
        assert float(info["lr"]) == float(shown["lr"])
        applied += not bool(info["found_inf"])
    assert applied == 6 and int(state.tx_state[2].count) == 6


def test_get_hyperparams_of_the_engines_state_shows_the_scheduled_lr():
    """``get_hyperparams(state, tx)`` on the state ``engine.step`` returns (a ``ZeroState``, as the
    README shows it) had every stored hyperparameter but no ``lr``: the chain's members were
    paired with the master and the transform state. It gives what it gives for the transform
    state: the schedule at the count of applied updates, for clipping + AdamW with warmup and
    cosine decay, the lr the next step applies."""
    sched = transforms.warmup_cosine_decay(1e-3, 1e-2, 2, 8, end_value=1e-4)
    tx = transforms.chain(transforms.clip_by_global_norm(1.0), transforms.adamw(lr=sched, weight_decay=0.1))
    engine = fzero.zero1(tx, param_dtype=torch.bfloat16)
    p0 = odd_params()
    params, state, ss = engine.init(p0)
    for i in range(3):
        params, state, ss, _ = engine.step(params, optree.tree_map(lambda g: g.bfloat16(), grads_like(p0, i)), state, ss)
    shown = transforms.get_hyperparams(state, tx)
    assert set(shown) == {"max_norm", "b1", "b2", "eps", "weight_decay", "lr"}
    assert torch.equal(shown["lr"], sched(torch.tensor(3, dtype=torch.int32))) and float(shown["lr"]) != float(sched(0))
    assert all(torch.equal(v, transforms.get_hyperparams(state.tx_state, tx)[k]) for k, v in shown.items())
    info = engine.step(params, optree.tree_map(lambda g: g.bfloat16(), grads_like(p0, 3)), state, ss)[3]
    assert float(info["lr"]) == float(shown["lr"])
