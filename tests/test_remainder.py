"""fzero.remainder and ``zero1(master="remainder")``: the FP32 master as (BF16 param, int16
remainder), exact; training bit for bit equal to an FP32 master, in 10S bytes of state."""
import hashlib
import os

import optree
import pytest
import torch

import fzero
import fzero.checkpoint
from distributed import run_ranks
from fzero.remainder import join, round_bf16, split
from helpers import grads_like, load_train_module, master_tx, odd_params, train_with_master

STEPS, BAD_STEP = 30, 7


def fp32_patterns(n=1_000_000, seed=0):
    """Random FP32 bit patterns (finite, within BF16's range) and exact ties (low 16 bits 0x8000)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = (torch.randint(-2**15, 2**15, (n // 100,), generator=g).to(torch.int32) << 16) | 0x8000
    m = torch.cat([bits, ties]).view(torch.float32)
    return m[torch.isfinite(m) & (m.abs() < torch.finfo(torch.bfloat16).max)]


def assert_rounds_as_the_int32_form(got, x):
    """``got``, some form of ``round_bf16(x)``: the int32 form's BF16 bits, and NaN where ``x`` is."""
    want, nan = fzero.remainder._round_bf16_bits(x), x.isnan()
    assert got[nan].isnan().all()
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_split_and_join_are_exact_and_the_rounding_is_nearest_ties_away():
    m = fp32_patterns()
    p = round_bf16(m)
    r = split(m, p)
    assert r.dtype == torch.int16
    assert torch.equal(join(p, r).view(torch.int32), m.view(torch.int32))  # bit for bit
    rne = m.to(torch.bfloat16)
    differ = p.view(torch.int16) != rne.view(torch.int16)
    ties = (m.view(torch.int32) & 0xFFFF) == 0x8000
    assert differ.any() and torch.equal(differ, differ & ties)  # only exact ties differ from torch's cast
    assert torch.all(p[ties].float().abs() > m[ties].abs())  # ... and those go away from zero
    assert torch.all((p.float() - m).abs() <= (rne.float() - m).abs())  # still to nearest
    nan = torch.tensor([float("nan"), float("inf"), -float("inf")])
    out = round_bf16(nan)
    assert out[0].isnan() and out[1] == float("inf") and out[2] == -float("inf")


def test_a_master_beyond_bf16s_range_saturates_instead_of_wrapping():
    """Near FP32's largest values the params saturate at BF16's largest finite value; the int16
    remainder used to wrap (3.40e38 came back as 3.3867e38, below values that are smaller)."""
    big = torch.tensor([3.40e38, -3.40e38, torch.finfo(torch.float32).max, 3.3962e38, 3.3960e38])
    p = fzero.engine.cast_params(big, torch.bfloat16)
    back = join(p, split(big, p))
    assert torch.equal(back[:4].abs(), torch.full((4,), fzero.remainder.MAX_JOINED))
    assert torch.equal(back[1:2], -back[0:1]) and back[4] == big[4]  # within range: exact as before
    engine = fzero.zero1(tx(), param_dtype=torch.bfloat16, master="remainder")
    params, state, _ = engine.init({"w": big.clone()})
    assert torch.equal(engine.with_fp32_master(params, state).master[:5], back)


def test_every_form_of_the_rounding_is_bit_for_bit_the_int32_one():
    """``round_bf16`` compiled for a CPU (FP32 arithmetic, ``_round_bf16_arith``), eager (torch's
    cast and a fix-up of its ties, ``_round_bf16_cast``) and the arithmetic form run eagerly give
    the int32 form's BF16 values on random patterns, exact ties, subnormals of both signs, values
    near BF16's and FP32's largest, zeros, inf and NaN (with payloads a tie's low bits would
    carry into the sign or the exponent)."""
    g = torch.Generator().manual_seed(1)
    edges = torch.tensor([0, 1, 0x8000, 0x18000, 0x7FFF, 0x007F8000, 0x007FFFFF, 0x00800000, 0x00808000, 0x3F7F8000,
                          0x3F7FFFFF, 0x3F808000, 0x3F818000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000,
                          0x7F800001, 0x7F808000, 0x7FFE8000, 0x7FFF8000, 0x7FFFFFFF],
                         dtype=torch.int64).to(torch.int32)
    subnormal = torch.randint(0, 2**23, (20_000,), generator=g, dtype=torch.int64).to(torch.int32)
    bits = torch.cat([edges, subnormal, torch.randint(-2**31, 2**31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)])
    x = torch.cat([fp32_patterns(200_000), bits.view(torch.float32), (bits | -2**31).view(torch.float32)])
    for got in (torch.compile(round_bf16, dynamic=False)(x), round_bf16(x), fzero.remainder._round_bf16_arith(x)):
        assert_rounds_as_the_int32_form(got, x)


# The binades (FP32 exponent fields) where the arithmetic form has its edges: subnormals and the
# smallest normals (BF16's fixed step), 1.0's, around 2^100 (tested at 2^-32 of their size from
# there) and 2^113 (where Veltkamp's C x would overflow), the largest, and inf/NaN.
# FZERO_ALL_BINADES=1: all 256 binades, every FP32 pattern (about 3 minutes).
EDGE_BINADES = [0, 1, 2, 127, 226, 227, 240, 241, 254, 255]
BINADES = range(256) if os.environ.get("FZERO_ALL_BINADES") == "1" else EDGE_BINADES


@pytest.fixture(scope="module")
def compiled_arith():
    return torch.compile(fzero.remainder._round_bf16_arith, dynamic=False)


@pytest.mark.parametrize("binade", BINADES)
def test_every_pattern_of_a_binade_rounds_bit_for_bit_the_same(binade, compiled_arith):
    """All 2 x 2^23 patterns with this exponent field, both signs: the compiled arithmetic form
    and the eager cast form give the int32 form's BF16 bits (NaN: a NaN)."""
    mantissas = torch.arange(2**23, dtype=torch.int32)
    bits = torch.cat([mantissas | (binade << 23), mantissas | (binade << 23) | -2**31])
    x = bits.view(torch.float32)
    for got in (compiled_arith(x), fzero.remainder._round_bf16_cast(x)):
        assert_rounds_as_the_int32_form(got, x)


@pytest.mark.parametrize("flag", [("enable_floating_point_contract_flag", "fast"), ("enable_unsafe_math_opt_flag", True)],
                         ids=["fp-contract", "unsafe-math"])
def test_compiled_rounding_stays_exact_when_inductor_may_fuse_or_reorder_fp_ops(flag):
    """Compiled with FMA contraction or unsafe math, the arithmetic form is wrong (Veltkamp's
    split needs each product rounded); ``round_bf16`` then stays on the bits."""
    mantissas = torch.arange(0, 2**23, 7, dtype=torch.int32)
    x = torch.cat([mantissas | (b << 23) for b in (1, 127, 240)]).view(torch.float32)
    try:
        with torch._inductor.config.patch({f"cpp.{flag[0]}": flag[1]}):
            got = torch.compile(round_bf16, dynamic=False)(x)
    finally:
        # a kernel built with unsafe math turns on flush-to-zero for the whole process when it
        # loads (GCC's crtfastmath): later tests would see subnormals as zeros
        torch.set_flush_denormal(False)
    assert_rounds_as_the_int32_form(got, x)


def test_cast_params_rounds_bf16_the_same_way():
    m = fp32_patterns(10_000)
    assert torch.equal(fzero.engine.cast_params(m, torch.bfloat16).view(torch.int16), round_bf16(m).view(torch.int16))


tx = master_tx


def train(master, *, compiled=False, donate=False, rank=0, steps=STEPS, engine_kw=None):
    return train_with_master(master, torch.bfloat16, steps=steps, bad_step=BAD_STEP, compiled=compiled, donate=donate,
                             rank=rank, engine_kw=engine_kw)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_remainder_trains_bit_for_bit_like_an_fp32_master(compiled, donate):
    ref_engine, _, ref_state, ref, _ = train("fp32", compiled=compiled, donate=donate)
    engine, params, state, got, _ = train("remainder", compiled=compiled, donate=donate)
    assert [bool(f) for _, f in got] == [s == BAD_STEP for s in range(STEPS)]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(ref, got))  # params at every step
    assert state.master.dtype == torch.int16
    assert torch.equal(engine.with_fp32_master(params, state).master, ref_state.master)
    for a, b in zip(optree.tree_leaves(ref_state.tx_state), optree.tree_leaves(state.tx_state)):
        assert torch.equal(a, b)
    # 10 bytes per element instead of 12 (+ the bool mask and 0-d scalars in both)
    S = engine.layout.shard_numel
    assert ref_engine.state_bytes(ref_state) - engine.state_bytes(state) == 2 * S


def two_ranks(rank, world_size):
    return {master: train(master, rank=rank, steps=10)[1] for master in ("fp32", "remainder")}  # the params


@pytest.mark.multirank
def test_remainder_on_two_ranks_equals_fp32_master():
    for r in run_ranks(two_ranks, 2):
        assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(r["fp32"]), optree.tree_leaves(r["remainder"])))


MAIN_JOB_STEPS = 100


def main_job(rank, world_size, compiled):
    """The main job's BF16 run (examples/train.py's GPT, data, optimizer and train step; a small
    GPT) for ``MAIN_JOB_STEPS`` steps with each master: per step the loss, found_inf, grad norm
    and a digest of the params' bits, then the final state as FP32 master and moments."""
    train_py = load_train_module()
    args = train_py.parse_args(["--device", "cpu", "--config", "nano", "--block-size", "32", "--batch-size", "8",
                                "--dtype", "bf16", "--steps", str(MAIN_JOB_STEPS), "--grad-clip", "0.5"])
    train_py.check_args(args, world_size)
    data = train_py.load_data(args)
    lo, hi = rank * args.batch_size // world_size, (rank + 1) * args.batch_size // world_size
    out = {}
    for master in ("fp32", "remainder"):
        params, loss, _ = train_py.build(args, data, torch.device("cpu"))
        spike = torch.zeros(())  # inf on the steps picked below: a term whose grad overflows (a skipped step)
        loss_fn = lambda p, b: loss(p, b) + spike * p["ln_f"]["g"].float().sum()  # noqa: E731
        # BF16 has FP32's range: only a scale near FP32's largest can overflow (eager backward
        # does, now and then). Growing every 20 clean steps up to 2**127, it backs off when it does.
        scale = fzero.DynamicLossScale(init_scale=2.0**126, max_scale=2.0**127, growth_interval=20)
        engine = fzero.zero1(train_py.make_optimizer(args), param_dtype=torch.bfloat16, loss_scale=scale,
                             donate=True, master=master)
        params, state, ss = engine.init(params)
        step = train_py.make_train_step(engine, loss_fn, compile=compiled)
        history = []
        for s in range(MAIN_JOB_STEPS):
            batch = tuple(t[lo:hi] for t in data.get_batch("train", s, args.batch_size, args.seed))
            spike.fill_(float("inf") if s % 20 == 7 else 0.0)
            params, state, ss, value, info = step(params, state, ss, batch)
            bits = fzero.flatten(params, engine.layout).view(torch.int16).numpy().tobytes()
            norm = info["grad_norm"].float()  # compared by its bits: NaN on a skipped step
            history.append((value.item(), bool(info["found_inf"]), norm.item(), norm.view(torch.int32).item(),
                            hashlib.sha256(bits).hexdigest()))
        full = engine.with_fp32_master(params, state) if master == "remainder" else state
        out[master] = {"history": history, "master": full.master, "tx_state": optree.tree_leaves(full.tx_state),
                       "stored": state.master.dtype, "state_bytes": engine.state_bytes(state), "S": engine.layout.shard_numel}
    return out


@pytest.mark.multirank
# Compiled at 1 rank: compiling is most of the cost, and each rank compiles the same graph; the
# remainder's arithmetic does not depend on the world size, the sharding is held to it eagerly.
@pytest.mark.parametrize("world_size,compiled", [(1, False), (2, False), (1, True)],
                         ids=["1-eager", "2-eager", "1-compiled"])
def test_remainder_trains_the_main_job_bit_for_bit_like_an_fp32_master(world_size, compiled):
    """100 steps of the main job in BF16, with overflow skips all through and the grad norm
    clipped: the remainder master gives the same losses, skips, grad norms and params at every
    step, and the same FP32 master and moments at the end, as the FP32 master."""
    for rank, r in enumerate(run_ranks(main_job, world_size, compiled, timeout=600)):
        ref, got = r["fp32"], r["remainder"]
        skips = sum(found_inf for _, found_inf, _, _, _ in ref["history"])
        clipped = sum(norm > 0.5 for _, _, norm, _, _ in ref["history"])
        assert skips >= 5 and clipped >= 50, (skips, clipped)  # both paths really taken
        for s, (a, b) in enumerate(zip(ref["history"], got["history"])):
            assert a[:2] + a[3:] == b[:2] + b[3:], \
                f"rank {rank} step {s}: (loss, found_inf, grad norm, its bits, params digest) {a} != {b}"
        assert got["stored"] == torch.int16 and ref["stored"] == torch.float32
        assert torch.equal(got["master"], ref["master"])
        assert all(torch.equal(a, b) for a, b in zip(ref["tx_state"], got["tx_state"]))
        assert ref["state_bytes"] - got["state_bytes"] == 2 * ref["S"]


def test_remainder_needs_bf16_params():
    with pytest.raises(ValueError, match="needs param_dtype=torch.bfloat16, got torch.float16"):
        fzero.zero1(tx(), param_dtype=torch.float16, master="remainder")
    with pytest.raises(ValueError, match="master must be 'fp32', 'remainder' or 'params', got 'fp16'"):
        fzero.zero1(tx(), param_dtype=torch.bfloat16, master="fp16")


def save_and_continue(rank, world_size, path, master):
    """Save at step 10 with ``master``, then run 5 more steps: params after each."""
    engine, params, state, _, ss = train(master, rank=rank, steps=10)
    fzero.checkpoint.save(path, params, state, ss, engine)
    return continue_from(engine, params, state, ss, rank)


def continue_from(engine, params, state, ss, rank):
    out = []
    for s in range(10, 15):
        grads = optree.tree_map(lambda x: (x * 3).to(torch.bfloat16), grads_like(odd_params(), 10 * s + rank))
        params, state, ss, _ = engine.step(params, grads, state, ss)
        out.append(torch.cat([x.reshape(-1) for x in optree.tree_leaves(params)]))  # no padding: any layout
    return torch.stack(out)


def load_and_continue(rank, world_size, path, master, alignment=64):
    engine = fzero.zero1(tx(), param_dtype=torch.bfloat16, master=master, alignment=alignment)
    engine.init(odd_params(seed=3))
    params, state, ss, _ = fzero.checkpoint.load(path, engine)
    assert state.master.dtype == (torch.int16 if master == "remainder" else torch.float32)
    return continue_from(engine, params, state, ss, rank)


@pytest.mark.multirank
@pytest.mark.parametrize("saved,loaded", [("remainder", "fp32"), ("fp32", "remainder"), ("remainder", "remainder")])
def test_checkpoint_holds_the_fp32_master_and_loads_into_either_mode_and_layout(tmp_path, saved, loaded):
    """Saved on 2 ranks after 10 steps; loaded on 2 ranks with another layout (alignment 16, not
    64), in either mode: the next 5 steps follow the run that went straight on."""
    path = str(tmp_path / "ckpt")
    straight = run_ranks(save_and_continue, 2, path, saved)
    resumed = run_ranks(load_and_continue, 2, path, loaded, 16)
    # another layout sums the grad norm's squares in other rows: equal up to a BF16 rounding
    for a, b in zip(straight, resumed):
        torch.testing.assert_close(a, b, rtol=8e-3, atol=1e-6)
    # the stored master is the exact FP32 one: a remainder engine rebuilds what an FP32 one loads
    engine = fzero.zero1(tx(), param_dtype=torch.bfloat16, master="remainder")
    engine.init(odd_params())
    params, state, _, _ = fzero.checkpoint.load(path, engine)
    fp32 = fzero.zero1(tx(), param_dtype=torch.bfloat16)
    fp32.init(odd_params())
    _, state32, _, _ = fzero.checkpoint.load(path, fp32)
    assert torch.equal(engine.with_fp32_master(params, state).master, state32.master)
    with pytest.raises(fzero.checkpoint.CheckpointError, match="with_fp32_master"):
        fzero.checkpoint.export_full(str(tmp_path / "full.safetensors"), state, engine)
