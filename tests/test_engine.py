"""Single-process engine tests: parity with torch.optim.AdamW, loss scaling, skips, bad input."""

import optree
import pytest
import torch

import fzero
import fzero.comm
from fzero import transforms
from fzero.models import mlp
from helpers import grads_like, master_tree, odd_params, run_tx, torch_adamw, tree_assert_close, tree_equal


def test_fp32_parity_with_torch_adamw():
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    p0 = odd_params()
    engine = fzero.zero1(transforms.adamw(**kw), param_dtype=torch.float32, loss_scale=None)
    params, state, ss = engine.init(p0)
    grads_list = [grads_like(p0, i) for i in range(15)]
    for grads in grads_list:
        params, state, ss, info = engine.step(params, grads, state, ss)
        assert not info["found_inf"]
    tree_assert_close(params, torch_adamw(p0, grads_list, **kw), rtol=1e-5, atol=1e-6)
    assert state.tx_state[0].count.item() == 15


def test_init_does_not_touch_user_params_and_params_are_views_of_one_buffer():
    p0 = odd_params()
    copy = optree.tree_map(torch.clone, p0)
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float16)
    params, state, _ = engine.init(p0)
    grads = optree.tree_map(lambda g: g.half(), grads_like(p0, 0))
    params, *_ = engine.step(params, grads, state, _)
    assert tree_equal(p0, copy)
    leaves = optree.tree_leaves(params)
    base = leaves[0].untyped_storage().data_ptr()
    assert all(x.untyped_storage().data_ptr() == base and x.dtype == torch.float16 for x in leaves)
    assert optree.tree_structure(params) == optree.tree_structure(p0)


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_static_scale_master_matches_fp32_adamw_on_unscaled_grads(param_dtype):
    kw = dict(lr=1e-2, weight_decay=0.01)
    scale = 1024.0
    p0 = odd_params()
    engine = fzero.zero1(transforms.adamw(**kw), param_dtype=param_dtype, loss_scale=fzero.StaticLossScale(scale))
    params, state, ss = engine.init(p0)
    # grads are exact in the param dtype, so the unscaled grads are known exactly
    grads_list = [optree.tree_map(lambda g: g.to(param_dtype).float(), grads_like(p0, i)) for i in range(10)]
    for grads in grads_list:
        scaled = optree.tree_map(lambda g: (g * scale).to(param_dtype), grads)
        params, state, ss, info = engine.step(params, scaled, state, ss)
        assert info["loss_scale"].item() == scale
    # the master starts from p0 in FP32, as torch's FP32 reference does
    tree_assert_close(master_tree(engine, state), torch_adamw(p0, grads_list, **kw), rtol=1e-5, atol=1e-6)
    assert tree_equal(params, optree.tree_map(lambda m: m.to(param_dtype), master_tree(engine, state)))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_overflow_skips_bitwise_and_scale_backs_off_then_grows(bad, param_dtype):
    p0 = odd_params()
    policy = fzero.DynamicLossScale(init_scale=2.0**8, growth_interval=3)
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=param_dtype, loss_scale=policy)
    params, state, ss = engine.init(p0)
    cast = lambda t: optree.tree_map(lambda g: g.to(param_dtype), t)
    params, state, ss, _ = engine.step(params, cast(grads_like(p0, 0)), state, ss)  # non-trivial state
    grads = cast(grads_like(p0, 1))
    grads["blocks"][1]["g"][0, 0, 1] = bad
    new_params, new_state, new_ss, info = engine.step(params, grads, state, ss)
    assert info["found_inf"].item() is True
    assert info["loss_scale"].item() == 2.0**8
    assert not torch.isfinite(info["grad_norm"])
    assert tree_equal(new_params, params) and tree_equal(new_state, state)
    assert new_ss.scale.item() == 2.0**7
    # growth after growth_interval clean steps
    params, state, ss = new_params, new_state, new_ss
    for i in range(3):
        assert ss.scale.item() == 2.0**7
        params, state, ss, info = engine.step(params, cast(grads_like(p0, 2 + i)), state, ss)
        assert not info["found_inf"]
    assert ss.scale.item() == 2.0**8
    assert state.tx_state[0].count.item() == 4  # the skipped step did not count
    assert all(torch.isfinite(x).all() for x in optree.tree_leaves(state))


def test_grad_norm_is_the_unscaled_global_norm():
    p0 = odd_params()
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float32, loss_scale=fzero.StaticLossScale(8.0))
    params, state, ss = engine.init(p0)
    grads = grads_like(p0, 3)
    _, _, _, info = engine.step(params, optree.tree_map(lambda g: g * 8.0, grads), state, ss)
    want = torch.sqrt(sum((g.double() ** 2).sum() for g in optree.tree_leaves(grads)))
    torch.testing.assert_close(info["grad_norm"].double(), want, rtol=1e-6, atol=0)


def test_func_grad_mlp_bf16_halves_loss():
    gen = torch.Generator().manual_seed(0)
    p0 = mlp.init(gen, (16, 64, 64, 4))
    x = torch.randn(64, 16, generator=gen)
    y = torch.randn(64, 4, generator=gen)
    engine = fzero.zero1(transforms.adamw(lr=3e-3, weight_decay=0.0), param_dtype=torch.bfloat16, loss_scale=None)
    params, state, ss = engine.init(p0)
    batch = (x.bfloat16(), y)
    grad_fn = torch.func.grad_and_value(lambda p: fzero.scale_loss(mlp.loss(p, batch), ss))
    losses = []
    for _ in range(60):
        grads, loss = grad_fn(params)
        losses.append(loss.item())
        params, state, ss, info = engine.step(params, grads, state, ss)
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_fp16_dynamic_scaling_trains_mlp_under_func_grad():
    gen = torch.Generator().manual_seed(1)
    p0 = mlp.init(gen, (16, 64, 64, 4))
    x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen)
    engine = fzero.zero1(transforms.adamw(lr=3e-3, weight_decay=0.0), param_dtype=torch.float16,
                         loss_scale=fzero.DynamicLossScale(init_scale=2.0**24, growth_interval=10))
    params, state, ss = engine.init(p0)
    losses, skipped = [], 0
    for _ in range(60):
        grads, loss = torch.func.grad_and_value(lambda p: fzero.scale_loss(mlp.loss(p, (x.half(), y)), ss))(params)
        losses.append(loss.item() / ss.scale.item())
        params, state, ss, info = engine.step(params, grads, state, ss)
        skipped += int(info["found_inf"])
    assert skipped >= 1  # 2**24 overflows fp16 grads at first...
    assert losses[-1] < 0.5 * losses[0]  # ...and training recovers after the backoffs


def test_accumulated_of_the_wrong_size_raises_instead_of_being_truncated(ready):
    engine, params, state, ss, grads = ready
    n = engine.layout.padded_numel
    for bad in (torch.zeros(n + 5), torch.zeros(n - 1), torch.zeros(3)):
        acc = fzero.Accumulated(bad, torch.ones((), dtype=torch.int32))
        with pytest.raises(ValueError, match=rf"Accumulated grads are shape \({bad.numel()},\).*\({n},\)"):
            engine.step(params, acc, state, ss)
        with pytest.raises(ValueError, match="Accumulated grads are"):
            engine.accumulate(acc, grads)


def test_bad_mask_names_leaf():
    engine = fzero.zero1(transforms.adamw(weight_decay_mask={"w": True, "one": True, "blocks": [{"g": torch.ones(2, dtype=torch.bool)}, {"g": True}]}), param_dtype=torch.float16)
    with pytest.raises(ValueError, match="mask leaf 'blocks/0/g' has shape"):
        engine.init(odd_params())


# ---------------------------------------------------------------- overflow paths
def test_finite_grads_with_a_norm_past_fp32_squares_are_not_an_overflow():
    p0 = {"w": torch.ones(64)}
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, loss_scale=None)
    params, state, ss = engine.init(p0)
    grads = {"w": torch.full((64,), 1e20)}  # finite; every square is past FP32's max
    params, new_state, ss, info = engine.step(params, grads, state, ss)
    assert not info["found_inf"]
    torch.testing.assert_close(info["grad_norm"], torch.tensor(8e20), rtol=1e-6, atol=0)
    assert new_state.tx_state[0].count.item() == 1  # applied, not skipped
    torch.testing.assert_close(params["w"], torch.full((64,), 1 - 1e-2 * (1 + 1e-2)), rtol=1e-5, atol=0)
    grads["w"][3] = float("inf")  # a real overflow still is one
    _, _, _, info = engine.step(params, grads, new_state, ss)
    assert info["found_inf"]


# ---------------------------------------------------------------- transforms under the engine
def run_engine(tx, p0, grads_list, **kw):
    engine = fzero.zero1(tx, param_dtype=torch.float32, loss_scale=None, **kw)
    params, state, ss = engine.init(p0)
    infos = []
    for grads in grads_list:
        params, state, ss, info = engine.step(params, grads, state, ss)
        infos.append(info)
    return params, state, infos


def test_mask_clip_schedule_on_the_flat_shard_equal_the_pytree_transform():
    p0 = odd_params()
    grads_list = [grads_like(p0, i, scale=3.0) for i in range(8)]
    tx = transforms.chain(
        transforms.clip_by_global_norm(2.0),
        transforms.adamw(
            lr=transforms.warmup_cosine_decay(0.0, 1e-2, 3, 8),
            weight_decay=0.3,
            weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p),
        ),
    )
    params, state, infos = run_engine(tx, p0, grads_list)
    tree_assert_close(params, run_tx(tx, p0, grads_list)[0], rtol=1e-5, atol=1e-7)
    # info reports the norm before clipping
    torch.testing.assert_close(infos[0]["grad_norm"], transforms.global_norm(grads_list[0]), rtol=1e-6, atol=0)
    assert infos[0]["grad_norm"] > 2.0


def test_skipped_steps_do_not_advance_schedules():
    p0 = odd_params()
    sched = transforms.linear_warmup(0.0, 1e-2, 4)
    grads_list = [grads_like(p0, i) for i in range(6)]
    bad = optree.tree_map(torch.clone, grads_list[2])
    bad["w"][0, 0] = float("nan")
    params, state, infos = run_engine(transforms.adamw(lr=sched), p0, grads_list[:2] + [bad] + grads_list[2:])
    assert [bool(i["found_inf"]) for i in infos] == [False, False, True, False, False, False, False]
    tree_assert_close(params, run_tx(transforms.adamw(lr=sched), p0, grads_list)[0], rtol=1e-6, atol=1e-8)
    assert state.tx_state[2].count.item() == 6


def test_changing_lr_between_steps_takes_effect():
    p0 = odd_params()
    grads_list = [grads_like(p0, i) for i in range(4)]
    tx = transforms.adamw(lr=1e-2)
    engine = fzero.zero1(tx, param_dtype=torch.float32, loss_scale=None)
    params, state, ss = engine.init(p0)
    ref_state, ref = tx.init(p0), p0
    for i, grads in enumerate(grads_list):
        if i == 2:
            state = transforms.set_hyperparams(state, lr=1e-1)  # works on the whole engine state
            ref_state = transforms.set_hyperparams(ref_state, lr=1e-1)
        params, state, ss, _ = engine.step(params, grads, state, ss)
        updates, ref_state = tx.update(grads, ref_state, ref)
        ref = transforms.apply_updates(ref, updates)
    assert transforms.get_hyperparams(state)["lr"].item() == pytest.approx(1e-1)
    tree_assert_close(params, ref, rtol=1e-6, atol=1e-8)
    unchanged = run_engine(tx, p0, grads_list)[0]
    assert not torch.allclose(params["w"], unchanged["w"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.float32])
def test_accumulation_equals_one_step_on_the_sum_and_skips_whole_update_on_overflow(param_dtype):
    p0 = odd_params()
    micro = [optree.tree_map(lambda g: g.to(param_dtype), grads_like(p0, i)) for i in range(4)]
    total = optree.tree_map(lambda *gs: torch.stack([g.float() for g in gs]).sum(0), *micro)  # as DDP's no_sync
    loss_scale = fzero.StaticLossScale(1.0) if param_dtype == torch.float16 else None
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=param_dtype, loss_scale=loss_scale)
    params, state, ss = engine.init(p0)
    acc = None
    for g in micro:
        acc = engine.accumulate(acc, g)
    assert acc.count.item() == 4 and acc.grads.dtype == torch.float32
    params1, state1, _, info = engine.step(params, acc, state, ss)
    ref = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, loss_scale=None)
    rp, rs, rss = ref.init(p0)
    _, rs, _, ref_info = ref.step(rp, total, rs, rss)
    torch.testing.assert_close(state1.master, rs.master, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(info["grad_norm"], ref_info["grad_norm"], rtol=1e-6, atol=0)  # the sum's, not the mean's
    # an inf in one micro-batch skips the whole update
    bad = optree.tree_map(torch.clone, micro[1])
    bad["one"][0] = float("inf")
    acc = None
    for g in [micro[0], bad, micro[2]]:
        acc = engine.accumulate(acc, g)
    params2, state2, _, info = engine.step(params, acc, state, ss)
    assert info["found_inf"] and tree_equal(state2, state) and tree_equal(params2, params)


@pytest.mark.parametrize("world_size", [2, 3])
def test_simulated_ranks_hold_their_shard_of_the_one_process_state(world_size):
    p0 = odd_params()
    grads_list = [grads_like(p0, i) for i in range(3)]
    ref = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, loss_scale=None, alignment=4)
    params, state, ss = ref.init(p0)
    for g in grads_list:
        params, state, ss, _ = ref.step(params, g, state, ss)
    shards = []
    for r in range(world_size):
        sim = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, loss_scale=None, alignment=4, simulate=(r, world_size))
        sp, s, sss = sim.init(p0)
        for g in grads_list:
            sp, s, sss, _ = sim.step(sp, g, s, sss)
        S = sim.layout.shard_numel
        assert sim.state_bytes(s) - 12 * S < 64
        shards.append(s.master)
    master = torch.cat(shards)[: sim.layout.numel]
    torch.testing.assert_close(master, state.master[: sim.layout.numel], rtol=1e-6, atol=1e-7)


def test_an_engine_is_bound_once_by_init(ready):
    engine, params, state, ss, grads = ready
    layout = engine.layout
    _, state2, _ = engine.init(odd_params(seed=1))  # same layout: a fresh state, same binding
    assert engine.layout is layout and state2.master.shape == state.master.shape
    with pytest.raises(ValueError, match="bound to other params"):
        engine.init({"x": torch.zeros(300)})
    assert engine.layout is layout  # the running step is untouched
    params, state, ss, info = engine.step(params, grads, state, ss)
    assert not info["found_inf"]


@pytest.mark.parametrize("world_size", [1, 3])
def test_an_injected_simulated_communicator_is_the_simulate_shorthand(world_size):
    p0, g = odd_params(), grads_like(odd_params(), 0)
    out = []
    for kw in (dict(simulate=(world_size - 1, world_size)), dict(group=fzero.comm.SimulatedComm(world_size - 1, world_size))):
        engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, loss_scale=None, **kw)
        params, state, ss = engine.init(p0)
        out.append(engine.step(params, g, state, ss)[1].master)
    assert torch.equal(out[0], out[1])
    with pytest.raises(ValueError, match=r"rank 3 is not in \[0, 3\)"):
        fzero.comm.SimulatedComm(3, 3)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("simulate", [None, (1, 2)])
def test_grads_of_the_flat_buffer_equal_the_pytree_path(donate, simulate):
    gen = torch.Generator().manual_seed(0)
    p0 = mlp.init(gen, (16, 64, 4))
    batch = (torch.randn(32, 16, generator=gen).half(), torch.randn(32, 4, generator=gen))
    kw = dict(param_dtype=torch.float16, donate=donate, simulate=simulate, bucket_bytes=1024)
    engine = fzero.zero1(transforms.adamw(lr=1e-2), **kw)
    a, b = list(engine.init(p0)), list(engine.init(p0))
    for _ in range(3):
        ga = torch.func.grad(lambda p: fzero.scale_loss(mlp.loss(p, batch), a[2]))(a[0])
        flat = engine.flat_params(b[0])
        gb = torch.func.grad(lambda f: fzero.scale_loss(mlp.loss(fzero.unflatten(f, engine.layout), batch), b[2]))(flat)
        assert gb.shape == (engine.layout.padded_numel,)
        a[0], a[1], a[2], _ = engine.step(a[0], ga, a[1], a[2])
        b[0], b[1], b[2], _ = engine.step(b[0], gb, b[1], b[2])
    assert tree_equal(a[1], b[1]) and tree_equal(a[0], b[0])
    # the flat buffer itself as params: new params come back flat, same values
    flat_new, flat_state, _, _ = engine.step(engine.flat_params(b[0]), gb, b[1], b[2])
    ref_new, ref_state, _, _ = engine.step(a[0], ga, a[1], a[2])
    assert flat_new.shape == (engine.layout.padded_numel,) and tree_equal(fzero.unflatten(flat_new, engine.layout), ref_new)
    assert tree_equal(flat_state, ref_state)
    with pytest.raises(TypeError, match="flat grads have dtype torch.float32"):
        engine.step(b[0], gb.float(), flat_state, b[2])
    with pytest.raises(ValueError, match="not views of one flat buffer"):
        engine.flat_params(optree.tree_map(torch.clone, b[0]))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "generic"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_scheduled_lr_skips_the_step_and_info_shows_the_lr(fused, bad):
    """A schedule that returns NaN/inf made the master NaN. Now the step is skipped like an
    overflow (master, moments and counts keep their bits), the loss scale is not touched, and
    ``info["lr"]`` is the value the schedule gave."""
    schedule = lambda count: torch.where(torch.as_tensor(count) == 2, bad, 1e-2 * (torch.as_tensor(count) + 1.0))
    tx = transforms.adamw(lr=schedule, weight_decay=0.1)
    tx = tx if fused else tx._replace(fused=None)
    engine = fzero.zero1(tx, param_dtype=torch.float16, loss_scale=fzero.StaticLossScale(4.0))
    p0 = odd_params()
    params, state, ss = engine.init(p0)
    grads = optree.tree_map(lambda g: (4 * g).half(), grads_like(p0, 0))
    lrs = []
    for i in range(4):
        before = (state, ss)
        params, state, ss, info = engine.step(params, grads, state, ss)
        lrs.append(float(info["lr"]))
        assert not info["found_inf"] and torch.equal(ss.scale, before[1].scale)
        if i == 2:  # the count stays at 2 (the schedule's bad value), so every later step skips too
            assert tree_equal(state, before[0])
        assert torch.isfinite(state.master).all()
    assert lrs[:2] == [pytest.approx(1e-2), pytest.approx(2e-2)] and all(x != x or x == bad for x in lrs[2:])


def test_the_grad_norm_of_an_overflow_is_one_nan_whatever_the_grads_held():
    """A NaN's sign and payload follow the operands the kernels met first (they changed with the
    fusion of a compiled graph); the reported norm is the one canonical NaN, inf stays inf."""
    p0 = {"w": torch.zeros(300)}
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.bfloat16)
    params, state, ss = engine.init(p0)
    odd_nan = torch.tensor([-1], dtype=torch.int16).view(torch.bfloat16)  # 0xFFFF: a negative NaN with a payload
    for bad, bits in ((odd_nan, 0x7FC00000), (torch.tensor(float("inf"), dtype=torch.bfloat16), 0x7F800000)):
        grads = {"w": torch.zeros(300, dtype=torch.bfloat16)}
        grads["w"][7] = bad
        info = engine.step(params, grads, state, ss)[3]
        assert info["found_inf"] and info["grad_norm"].view(torch.int32).item() == bits


@pytest.mark.parametrize("moments,master,per_element", [
    (torch.bfloat16, "fp32", 4 + 2 + 2), (torch.bfloat16, "remainder", 2 + 2 + 2),
    (torch.int8, "fp32", 4 + 1 + 1 + 8 / 256), (torch.int8, "remainder", 2 + 1 + 1 + 8 / 256),
])
@pytest.mark.parametrize("world_size", [2, 3])
def test_stored_moments_hold_their_bytes_and_ranks_hold_their_shard_of_the_one_process_state(
        moments, master, per_element, world_size):
    """8-bit moments: every rank's slice is whole 256-element blocks, so the blocks (and their
    scales) are those of the one-process shard, cut at the rank's edges."""
    p0 = odd_params()
    grads_list = [optree.tree_map(lambda g: g.bfloat16(), grads_like(p0, i)) for i in range(3)]

    def trained(simulate):
        engine = fzero.zero1(transforms.adamw(lr=1e-2, mu_dtype=moments, nu_dtype=moments),
                             param_dtype=torch.bfloat16, master=master, simulate=simulate)
        params, state, ss = engine.init(p0)
        for g in grads_list:
            params, state, ss, _ = engine.step(params, g, state, ss)
        return engine, state

    ref, ref_state = trained(None)
    adam = ref_state.tx_state[0]
    for r in range(world_size):
        sim, state = trained((r, world_size))
        S = sim.layout.shard_numel
        if moments == torch.int8:
            assert sim.layout.alignment == 256 and S % 256 == 0
        assert 0 <= sim.state_bytes(state) - per_element * S < 64  # + the 0-d leaves
        lo = r * S  # one bucket: rank r owns flat[lo:lo + S]; past the one-process shard, padding
        n = max(0, min(S, ref.layout.shard_numel - lo))
        mine = state.tx_state[0]
        for got, want in ((mine.mu, adam.mu), (mine.nu, adam.nu)):
            if moments == torch.int8:
                assert torch.equal(got.codes[:n], want.codes[lo:lo + n])
                assert torch.equal(got.scale[:n // 256], want.scale[lo // 256:(lo + n) // 256])
                assert not got.codes[n:].any() and not got.scale[n // 256:].any()
            else:
                assert torch.equal(got[:n], want[lo:lo + n]) and not got[n:].any()
