import math

import pytest
import torch

import transforms


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
