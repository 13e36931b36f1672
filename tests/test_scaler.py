import pytest
import torch

import fzero
from fzero.scaler import DynamicLossScale, StaticLossScale
from helpers import reference


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_dynamic_matches_reference_rule(hysteresis):
    policy = DynamicLossScale(init_scale=2.0**10, growth_interval=3, hysteresis=hysteresis, min_scale=2.0**6, max_scale=2.0**12)
    g = torch.Generator().manual_seed(hysteresis)
    found = (torch.rand(300, generator=g) < 0.3).tolist()
    state = policy.init()
    for inf, (scale, good, hyst) in zip(found, reference(policy, found)):
        state = policy.update(state, torch.tensor(inf))
        assert (state.scale.item(), state.good_steps.item(), state.hysteresis.item()) == (scale, good, hyst)
    assert state.scale.dtype == torch.float32 and state.good_steps.dtype == torch.int32


def test_seed_defaults_first_overflow_halves_and_growth_after_interval():
    policy = DynamicLossScale()
    assert (policy.init_scale, policy.growth_factor, policy.backoff_factor, policy.growth_interval) == (2.0**16, 2.0, 0.5, 2000)
    assert (policy.hysteresis, policy.min_scale, policy.max_scale) == (1, 1.0, 2.0**24)
    s = policy.update(policy.init(), torch.tensor(True))
    assert s.scale.item() == 2.0**15
    for _ in range(1999):
        s = policy.update(s, torch.tensor(False))
    assert s.scale.item() == 2.0**15
    s = policy.update(s, torch.tensor(False))
    assert s.scale.item() == 2.0**16 and s.good_steps.item() == 0


def test_clamped_to_min_and_max():
    p = DynamicLossScale(init_scale=2.0, min_scale=1.0, max_scale=4.0, growth_interval=1)
    s = p.init()
    for _ in range(5):
        s = p.update(s, torch.tensor(True))
    assert s.scale.item() == 1.0
    for _ in range(5):
        s = p.update(s, torch.tensor(False))
    assert s.scale.item() == 4.0


def test_static_never_changes_and_scale_loss():
    s = StaticLossScale(128.0).init()
    for inf in (True, False, True):
        s = StaticLossScale(128.0).update(s, torch.tensor(inf))
    assert s.scale.item() == 128.0
    loss = torch.tensor(0.5, dtype=torch.float16)
    assert fzero.scale_loss(loss, s).item() == 64.0
    assert fzero.scale_loss(loss, None) is loss


@pytest.mark.parametrize("bad", [dict(backoff_factor=0.0), dict(min_scale=4.0, init_scale=2.0), dict(hysteresis=0)])
def test_bad_config_raises(bad):
    with pytest.raises(ValueError):
        DynamicLossScale(**bad)


def test_stuck_after_k_overflows_at_min_scale_and_reset_by_a_clean_step():
    p = DynamicLossScale(init_scale=4.0, min_scale=1.0, stuck_after=3)
    s = p.init()
    flags = []
    for inf in [True] * 2 + [True] * 3 + [False] + [True] * 2:
        s = p.update(s, torch.tensor(inf))
        flags.append((s.scale.item(), s.stuck_steps.item(), bool(p.stuck(s))))
    # 4 -> 2 -> 1 (two backoffs), then three overflows at scale 1 -> stuck; a clean step resets
    assert flags == [(2.0, 0, False), (1.0, 0, False), (1.0, 1, False), (1.0, 2, False), (1.0, 3, True),
                     (1.0, 0, False), (1.0, 1, False), (1.0, 2, False)]


def test_static_scale_is_stuck_after_k_consecutive_overflows():
    p = StaticLossScale(8.0, stuck_after=2)
    s = p.init()
    for inf in (True, True):
        s = p.update(s, torch.tensor(inf))
    assert bool(p.stuck(s)) and s.scale.item() == 8.0


FP32_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("init_scale, growth_factor", [(2.0**127, 2.0), (2.0**126, 4.0), (2.0**125, 1e3)])
def test_growth_that_overflows_fp32_keeps_the_scale(init_scale, growth_factor):
    # max_scale is below FP32's max, so the clamp alone would not stop the overflow: the grown
    # scale is inf in FP32 (2**128 > FP32 max) and the old one must be kept, as jmp and torch do.
    p = DynamicLossScale(init_scale=init_scale, growth_factor=growth_factor, growth_interval=1, max_scale=3e38)
    s = p.init()
    for _ in range(3):
        s = p.update(s, torch.tensor(False))
        assert torch.isfinite(s.scale) and s.scale.item() == init_scale and s.good_steps.item() == 0
    s = p.update(s, torch.tensor(True))
    assert s.scale.item() == init_scale * p.backoff_factor


def test_growth_up_to_max_scale_still_happens_near_fp32_max():
    p = DynamicLossScale(init_scale=2.0**126, growth_interval=1, max_scale=3e38)
    s = p.update(p.init(), torch.tensor(False))
    assert s.scale.item() == 2.0**127  # 2**127 is finite: grown as usual


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(max_scale=INF), "max_scale"),
        (dict(max_scale=INF, init_scale=2.0**127), "max_scale"),
        (dict(max_scale=NAN), "max_scale"),
        (dict(max_scale=1e39), "max_scale"),  # a finite Python float, but inf in FP32
        (dict(min_scale=0.0), "min_scale"),
        (dict(min_scale=-1.0), "min_scale"),
        (dict(min_scale=NAN), "min_scale"),
        (dict(min_scale=-INF), "min_scale"),
        (dict(init_scale=INF), "init_scale"),
        (dict(init_scale=NAN), "init_scale"),
        (dict(init_scale=0.5), "init_scale"),  # below min_scale=1
        (dict(init_scale=2.0**25), "init_scale"),  # above max_scale=2**24
        (dict(growth_factor=INF), "growth_factor"),
        (dict(growth_factor=NAN), "growth_factor"),
        (dict(growth_factor=0.5), "growth_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(backoff_factor=1.5), "backoff_factor"),
        (dict(backoff_factor=NAN), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(growth_interval=1.5), "growth_interval"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(hysteresis=2.0), "hysteresis"),
        (dict(stuck_after=0), "stuck_after"),
    ],
)
def test_bad_dynamic_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=rf"DynamicLossScale: {field} must be "):
        DynamicLossScale(**bad)


@pytest.mark.parametrize("scale", [INF, -INF, NAN, 0.0, -2.0, 1e39])
def test_static_scale_must_be_finite_and_positive(scale):
    with pytest.raises(ValueError, match=r"StaticLossScale: scale must be "):
        StaticLossScale(scale)


@pytest.mark.parametrize("stuck_after", [0, -1, 2.5])
def test_static_stuck_after_is_a_positive_int(stuck_after):
    with pytest.raises(ValueError, match=r"StaticLossScale: stuck_after must be an integer >= 1, got "):
        StaticLossScale(4.0, stuck_after=stuck_after)


def test_limits_at_fp32_max_are_accepted():
    p = DynamicLossScale(init_scale=FP32_MAX, max_scale=FP32_MAX)
    assert p.init().scale.item() == FP32_MAX
    assert StaticLossScale(FP32_MAX).init().scale.item() == FP32_MAX


@pytest.mark.parametrize("field", ["min_scale", "init_scale"])
def test_scale_that_rounds_to_zero_in_fp32_raises(field):
    with pytest.raises(ValueError, match=rf"DynamicLossScale: {field} must be "):
        DynamicLossScale(**{field: 1e-50})  # > 0 as a Python float, 0 in FP32
