"""Fault injection: inf/NaN on random ranks, leaves and steps; aggressive initial scales."""
import optree
import pytest
import torch

import fzero
from fzero import transforms
from distributed import run_ranks
from fzero.models import mlp
from helpers import grads_like, odd_params, reference

STEPS = 200
POLICY = fzero.DynamicLossScale(init_scale=2.0**8, growth_interval=5, hysteresis=2, min_scale=2.0**4, max_scale=2.0**12)


def injection_plan(world_size, seed=0):
    """{step: (rank, leaf index, value)} for ~10% of the steps."""
    g = torch.Generator().manual_seed(seed)
    plan = {}
    for step in range(STEPS):
        if torch.rand((), generator=g) < 0.1:
            plan[step] = (int(torch.randint(world_size, (), generator=g)), int(torch.randint(4, (), generator=g)),
                          float("nan") if torch.rand((), generator=g) < 0.5 else float("inf"))
    return plan


def faulty_run(rank, world_size, plan):
    p0 = odd_params()
    sched = transforms.warmup_cosine_decay(0.0, 1e-2, 10, STEPS)
    engine = fzero.zero1(transforms.adamw(lr=sched), param_dtype=torch.float16, loss_scale=POLICY)
    params, state, ss = engine.init(p0)
    found, scales, counts, finite = [], [], [], True
    for step in range(STEPS):
        grads = optree.tree_map(lambda x: (x * ss.scale).half(), grads_like(p0, 1000 * step + rank))
        if step in plan and plan[step][0] == rank:
            leaf = optree.tree_leaves(grads)[plan[step][1]]
            leaf.view(-1)[0] = plan[step][2]
        params, state, ss, info = engine.step(params, grads, state, ss)
        found.append(bool(info["found_inf"]))
        scales.append(float(ss.scale))
        counts.append(int(state.tx_state[0].count))
        finite &= all(bool(torch.isfinite(t).all()) for t in optree.tree_leaves(state) if t.is_floating_point())
        finite &= all(bool(torch.isfinite(t).all()) for t in optree.tree_leaves(params))
    return {"found": found, "scales": scales, "counts": counts, "finite": finite,
            "params": fzero.flatten(params, engine.layout)}


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_injected_faults_are_skipped_everywhere_and_the_scale_follows_the_rule(world_size):
    plan = injection_plan(world_size, seed=world_size)
    out = run_ranks(faulty_run, world_size, plan)
    expected = [s in plan for s in range(STEPS)]
    assert sum(expected) > 10
    ref_scales = [s for s, _, _ in reference(POLICY, expected)]
    for r in out:
        assert r["found"] == expected  # every rank skips exactly the injected steps
        assert r["finite"]  # nothing non-finite ever reached master, moments or params
        assert r["scales"] == ref_scales  # the documented rule, exactly
        assert r["counts"] == [sum(not e for e in expected[: s + 1]) for s in range(STEPS)]  # skips don't count
        assert torch.equal(r["params"], out[0]["params"])
    moves = list(zip(ref_scales, ref_scales[1:]))
    assert any(b > a for a, b in moves) and any(b < a for a, b in moves)  # growth and backoff both exercised


@pytest.mark.slow
def test_aggressive_initial_scale_backs_off_then_converges():
    """The seed's "divergence under aggressive scaling": start at 2**24, where FP16 grads overflow."""
    gen = torch.Generator().manual_seed(3)
    p0 = mlp.init(gen, (32, 128, 128, 8))
    x, y = torch.randn(256, 32, generator=gen), torch.randn(256, 8, generator=gen)
    engine = fzero.zero1(transforms.adamw(lr=2e-3, weight_decay=0.0), param_dtype=torch.float16,
                         loss_scale=fzero.DynamicLossScale(init_scale=2.0**24, growth_interval=50))
    params, state, ss = engine.init(p0)
    found, losses = [], []
    for _ in range(150):
        grads, loss = torch.func.grad_and_value(lambda p: fzero.scale_loss(mlp.loss(p, (x.half(), y)), ss))(params)
        losses.append(float(loss) / float(ss.scale))
        params, state, ss, info = engine.step(params, grads, state, ss)
        found.append(bool(info["found_inf"]))
    first_clean = found.index(False)
    assert first_clean >= 3 and all(found[:first_clean])  # the early steps were skipped, backing off
    assert float(ss.scale) < 2.0**24 / 2**first_clean * 2**3  # the scale came down
    assert int(state.tx_state[0].count) == found.count(False)
    assert losses[-1] < 0.3 * losses[first_clean]  # and training converged afterwards


def stuck_run(rank, world_size):
    p0 = odd_params()
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float16,
                         loss_scale=fzero.DynamicLossScale(init_scale=4.0, min_scale=1.0, stuck_after=3))
    params, state, ss = engine.init(p0)
    stuck = []
    for step in range(6):
        grads = optree.tree_map(lambda x: x.half(), grads_like(p0, step))
        if rank == 1:
            grads["blocks"][1]["g"].view(-1)[0] = float("nan")  # a persistent NaN on one rank
        params, state, ss, info = engine.step(params, grads, state, ss)
        stuck.append(bool(info["scale_stuck"]))
    culprits = fzero.nonfinite_leaves(grads)  # off the hot path, once
    return {"stuck": stuck, "culprits": culprits}


@pytest.mark.multirank
def test_stuck_scale_is_reported_and_the_culprit_named():
    out = run_ranks(stuck_run, 2)
    # 4 -> 2 -> 1, then three overflows at the minimum: stuck from step 5 on, on both ranks
    assert [r["stuck"] for r in out] == [[False] * 4 + [True] * 2] * 2
    assert out[1]["culprits"] == ["blocks/1/g"] and out[0]["culprits"] == []
