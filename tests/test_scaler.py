import pytest
import torch

import fzero
from fzero.scaler import DynamicLossScale, StaticLossScale


def reference(policy, found):
    """The documented rule, in plain Python."""
    scale, good, hyst = policy.init_scale, 0, policy.hysteresis
    out = []
    for inf in found:
        if inf:
            good = 0
            hyst = max(hyst - 1, 0)
            if hyst == 0:
                scale = max(scale * policy.backoff_factor, policy.min_scale)
        else:
            good += 1
            if good == policy.growth_interval:
                good, hyst = 0, policy.hysteresis
                scale = min(scale * policy.growth_factor, policy.max_scale)
        out.append((scale, good, hyst))
    return out


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
