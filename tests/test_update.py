"""fzero.update and its CPU wing's chunks (``fzero.cpu.chunked``): the update variants (fused kernel chunk by
chunk, generic chunked, compiled chunks, generic on the whole shard), the plan's choice between them
(``fzero.plan``). The cast and the norm's sum of squares: tests/test_cast.py, tests/test_norm.py."""

import contextlib

import optree
import pytest
import torch

import fzero
import fzero.cpu.chunked
from fzero import transforms
from fzero.cast import IntoBuffer, IntoLeaves, IntoMaster, NewTensor, cast_params
from fzero.cpu.chunked import fused_chunks, generic_chunks
from fzero.grad_forms import Reduced
from fzero.update import ShardGrads, ask_fused, compiled_update, generic_whole
from fzero.models import mlp
from helpers import update_path as helpers_update_path
from helpers import (NewTensors, assert_compiled_state_close, grads_like, odd_params, step_plan, tree_assert_close,
                     tree_equal)


# ---------------------------------------------------------------- the variants, called directly
def shard_problem(S=1000, seed=0):
    """An AdamW (clip + schedule + masked decay) state on an FP32 ``[S]`` shard, and its FP16
    grads times 8 reduced: ``(tx, master, tx_state, grads)``."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(S, generator=gen)
    tx = transforms.chain(transforms.clip_by_global_norm(1.0),
                          transforms.adamw(lr=1e-2, weight_decay=0.1, weight_decay_mask=lambda p: p))
    mask = torch.arange(S) % 3 > 0
    tx_state = tx.init(master, context=transforms.ShardContext({"w": master}, lambda _: mask))
    g = (torch.randn(S, generator=gen) * 8).half()
    return tx, master, tx_state, ShardGrads.of(Reduced(g, 1.0, False), torch.tensor(8.0))


def update_path(plan) -> str:
    """The plan's update variant and the fallbacks it carries, by name: ``FusedChunks > Chunks``."""
    return helpers_update_path(plan, detail=False)


def run(variant, fused, tx, master, tx_state, grads, *, chunk, donate=False, out=None):
    skip, norm = torch.tensor(False), torch.tensor(3.0, dtype=torch.float64)
    return variant(tx, fused, grads, master, tx_state, skip, norm, param_dtype=torch.float16, chunk=chunk,
                   donate=donate, out=out, compiled=compiled_update())


def test_the_variants_share_one_signature_and_agree():
    """Generic chunked is bitwise the generic whole-shard update; the fused kernel agrees to float
    rounding; each returns (master, tx_state, params shard) and leaves its inputs alone."""
    tx, master, tx_state, grads = shard_problem()
    kept = optree.tree_map(torch.clone, (master, tx_state))
    skip, norm = torch.tensor(False), torch.tensor(3.0, dtype=torch.float64)
    fused = ask_fused(tx, tx_state, grads, skip, norm, torch.device("cpu"))
    assert update_path(step_plan(chunk=None, numel=master.numel())[0]) == "Fused > Whole" and fused is not None
    whole = run(generic_whole, None, tx, master, tx_state, grads, chunk=None)
    chunked = run(generic_chunks, None, tx, master, tx_state, grads, chunk=128)
    kernel = run(fused_chunks, fused, tx, master, tx_state, grads, chunk=128)
    assert tree_equal(whole, chunked)
    tree_assert_close(kernel[:2], whole[:2], rtol=1e-6, atol=1e-7)
    assert torch.equal(whole[2], cast_params(whole[0], torch.float16))
    assert tree_equal((master, tx_state), kept)  # pure without donate


def test_every_variant_casts_into_out_and_donated_writes_the_inputs():
    for variant, chunk in ((generic_whole, None), (generic_chunks, 100), (fused_chunks, 100)):
        tx, master, tx_state, grads = shard_problem()
        fused = ask_fused(tx, tx_state, grads, torch.tensor(False), torch.tensor(3.0, dtype=torch.float64),
                          torch.device("cpu")) if variant is fused_chunks else None
        out = torch.empty(master.numel(), dtype=torch.float16)
        new_master, _, shard = run(variant, fused, tx, master, tx_state, grads, chunk=chunk, donate=True, out=out)
        assert shard is out and torch.equal(out, cast_params(new_master, torch.float16))
        if variant is not generic_whole:  # in place, chunk by chunk
            assert new_master is master


def test_choose_takes_the_kernel_only_eager_and_when_the_transform_does_not_decline():
    tx, master, tx_state, grads = shard_problem()
    skip, norm, S = torch.tensor(False), torch.tensor(3.0, dtype=torch.float64), master.numel()
    assert update_path(step_plan(fused=False, chunk=None, numel=S)[0]) == "Whole"
    assert update_path(step_plan(fused=False, chunk=100, numel=S)[0]) == "Chunks"
    assert update_path(step_plan(fused=False, chunk=S, numel=S)[0]) == "Whole"
    assert update_path(step_plan(compiled=True, chunk=100, numel=S)[0]) == "Whole"  # compiled: never the kernel
    adam = tx_state[1][0]  # a hyperparameter made by arithmetic carries no host value: the kernel declines
    declined = (tx_state[0], (adam._replace(b2=adam.b2 * 1.0), *tx_state[1][1:]))
    plan = step_plan(chunk=100, numel=S)[0]
    assert update_path(plan) == "FusedChunks > Chunks" and ask_fused(tx, declined, grads, skip, norm, master.device) is None
    # the plan's fused variant runs the fallback it carries: generic_chunks, bitwise
    assert tree_equal(plan.update.run(tx, grads, master, declined, skip, norm),
                      run(generic_chunks, None, tx, master, declined, grads, chunk=100))


def test_choose_compiles_the_chunks_for_bf16_or_8_bit_state_from_compile_numel_up(monkeypatch):
    """Only BF16 or 8-bit state (not FP32 moments beside a decay mask's bools: ``Kernels.low_precision``,
    found at ``init``), only eager and chunked, only from ``COMPILE_NUMEL`` shard elements up."""
    monkeypatch.setattr(fzero.update, "COMPILE_NUMEL", 1000)
    skip, norm = torch.tensor(False), torch.tensor(3.0, dtype=torch.float64)
    p0 = {"w": torch.zeros(1024)}
    tx, master, tx_state, grads = shard_problem()  # FP32 moments, a bool mask
    engine = fzero.zero1(tx, param_dtype=torch.float16)
    engine.init(p0)
    assert not engine._kernels.low_precision
    assert update_path(step_plan(fused=False, chunk=100, numel=1000)[0]) == "Chunks"
    for moments in (torch.bfloat16, torch.int8):
        low = transforms.adamw(lr=1e-2, mu_dtype=moments, nu_dtype=moments)
        engine = fzero.zero1(low, param_dtype=torch.float16)
        state = engine.init(p0)[1].tx_state
        assert engine._kernels.low_precision
        assert update_path(step_plan(fused=False, chunk=256, numel=1024, low_precision=True)[0]) == "CompiledChunks"
        # fused where the transform gives its form: it declines BF16 or 8-bit moments, the chunks compile
        assert update_path(step_plan(chunk=256, numel=1024, low_precision=True)[0]) == "FusedChunks > CompiledChunks"
        assert ask_fused(low, state, grads, skip, norm, torch.device("cpu")) is None
        monkeypatch.setattr(fzero.update, "COMPILE_NUMEL", 1025)
        assert update_path(step_plan(fused=False, chunk=256, numel=1024, low_precision=True)[0]) == "Chunks"
        monkeypatch.setattr(fzero.update, "COMPILE_NUMEL", 1000)
        assert update_path(step_plan(fused=False, chunk=None, numel=1024, low_precision=True)[0]) == "Whole"
        assert update_path(step_plan(compiled=True, fused=False, chunk=256, numel=1024, low_precision=True)[0]) == (
            "Whole")


def test_step_plan_decides_each_mode_once():
    kw = dict(chunk=256, native=True, native_leaves=True, leaves=True)
    m = step_plan(donate=True, flat_in=False, **kw)[0]  # eager, fused, chunked; cast into the params' own buffer
    assert not m.compiled and update_path(m) == "Native > FusedChunks > Chunks" and m.update.fallback.chunk == 256
    assert isinstance(m.cast, IntoBuffer) and m.params.buffer is not None
    m2 = step_plan(donate=True, world_size=2, flat_in=False, chunk=64, native=False)[0]
    assert update_path(m2) == "FusedChunks > Chunks" and isinstance(m2.cast, NewTensor)
    pure = step_plan(fused=False, **kw)[0]
    assert update_path(pure) == "Chunks" and isinstance(pure.cast, NewTensor) and not pure.gather.write
    compiled = step_plan(compiled=True, donate=True, flat_in=False, **kw)[0]
    assert compiled.compiled and compiled.update.fallback.into is compiled.cast  # no chunks compiled
    # compiled from a pytree at world size 1, where the engine allows it: cast leaf by leaf into
    # the params' own buffer, by the kernel where it runs the update (it is asked first)
    assert update_path(compiled) == "Native > CompiledLeaves" and isinstance(compiled.cast, IntoLeaves)
    plain = step_plan(compiled=True, donate=True, flat_in=False, **{**kw, "leaves": False})[0]
    assert update_path(plain) == "Whole" and isinstance(plain.cast, NewTensor)
    assert not plain.gather.write and plain.params.buffer is None  # FP16 pytree leaves: a new buffer
    # leaf by leaf where the kernel declines the transform (``native_leaves`` false at init): its loops
    declined = step_plan(compiled=True, donate=True, flat_in=False, **{**kw, "native_leaves": False})[0]
    assert update_path(declined) == "CompiledLeaves"
    # compiled on the flat buffer, donated, where the engine has fzero's CPU kernel: it casts into
    # the params' own buffer (at world size 1); compiled pure, no kernel; eager with a fused form,
    # donated or pure, the kernel; not at world size 2
    flat = step_plan(compiled=True, donate=True, **kw)[0]
    assert update_path(flat) == "Native > Whole" and isinstance(flat.cast, IntoBuffer)
    flat_pure = step_plan(compiled=True, **kw)[0]
    assert update_path(flat_pure) == "Whole" and update_path(pure) == "Chunks"  # pure: eager without a fused form
    eager_pure = step_plan(flat_in=False, **kw)[0]
    assert update_path(eager_pure).startswith("Native >") and isinstance(eager_pure.cast, NewTensor)
    assert not update_path(step_plan(donate=True, world_size=2, **{**kw, "chunk": 64})[0]).startswith(
        "Native")
    # the eager norm runs the kernel at any world size, pure or donated; the compiled one is
    # inductor's, but where the kernel runs the update leaf by leaf
    native_norm = lambda p: type(p.norm).__name__ == "NativeNorm"  # noqa: E731
    assert native_norm(m) and native_norm(step_plan(world_size=2, **{**kw, "chunk": 64})[0])
    assert native_norm(compiled) and not native_norm(declined) and not native_norm(flat)
    # FP32 params that are their master (master="params"): the update writes them as the master
    # where it writes into their own buffer, never into a pure step's inputs
    kw = {**kw, "param_dtype": torch.float32, "master": "params"}
    assert isinstance(step_plan(donate=True, flat_in=False, **kw)[0].cast, IntoMaster)
    assert not isinstance(step_plan(flat_in=False, **kw)[0].cast, IntoMaster)
    assert not isinstance(step_plan(donate=True, world_size=2, **{**kw, "chunk": 64})[0].cast, IntoMaster)


# ---------------------------------------------------------------- through the engine
@pytest.mark.parametrize("param_dtype,big", [(torch.float16, 65000.0), (torch.bfloat16, 3.38e38)])
def test_update_past_the_param_dtype_range_saturates_instead_of_writing_inf(param_dtype, big):
    top = torch.finfo(param_dtype).max
    p0 = {"w": torch.tensor([big, -big, 1.0])}
    # Adam's first step moves each element by lr against the grad's sign: past the dtype's range.
    lr = 2 * (top - big) + 1e3 if param_dtype == torch.float16 else 2e36
    engine = fzero.zero1(transforms.adamw(lr=lr, weight_decay=0.0), param_dtype=param_dtype, loss_scale=None)
    params, state, ss = engine.init(p0)
    grads = {"w": torch.tensor([-1.0, 1.0, 0.0]).to(param_dtype)}
    params, state, ss, info = engine.step(params, grads, state, ss)
    assert not info["found_inf"]
    assert torch.isfinite(state.master).all()
    assert state.master[0] > top and state.master[1] < -top  # the master keeps the exact value
    assert params["w"][0].item() == top and params["w"][1].item() == -top  # the copy saturates
    assert torch.isfinite(params["w"]).all()


def test_init_with_params_beyond_the_fp16_range_saturates():
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float16)
    params, state, _ = engine.init({"w": torch.tensor([1e5, -1e6, 2.0])})
    assert params["w"].tolist() == [65504.0, -65504.0, 2.0]
    assert state.master[:3].tolist() == [1e5, -1e6, 2.0]


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("moments", [None, torch.bfloat16, torch.int8])
def test_chunked_eager_update_is_bitwise_the_whole_shard_update(param_dtype, donate, moments):
    """8-bit moments: chunks of 100 become one 256-element block each, the per-block scales cut
    with them (6 chunks of the 1536-element shard)."""
    p0 = mlp.init(torch.Generator().manual_seed(0), (16, 64, 4))  # 1348 elements: 14 chunks of 100, the last partial
    grads_list = [optree.tree_map(lambda g: (g * 8).to(param_dtype), grads_like(p0, i)) for i in range(5)]
    grads_list[2]["layers"][1]["w"][3, 1] = float("nan")  # a skipped step in the middle
    tx = transforms.chain(
        transforms.clip_by_global_norm(1.0),
        transforms.adamw(lr=transforms.linear_warmup(0.0, 1e-2, 3), weight_decay=0.1,
                         weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p),
                         mu_dtype=moments, nu_dtype=moments),
    )
    out = {}
    for chunk in (None, 100):
        engine = fzero.zero1(tx, param_dtype=param_dtype, loss_scale=fzero.StaticLossScale(8.0), donate=donate,
                             chunk_numel=chunk)
        params, state, ss = engine.init(p0)
        state0, master0 = state, state.master.clone()
        for grads in grads_list:
            params, state, ss, info = engine.step(params, grads, state, ss)
        if donate:  # updated in place, chunk by chunk
            assert state.master.data_ptr() == state0.master.data_ptr()
            assert all(a.data_ptr() == b.data_ptr() for a, b in zip(optree.tree_leaves(state.tx_state),
                                                                    optree.tree_leaves(state0.tx_state)) if a.ndim)
        else:  # pure: the input state is untouched
            assert torch.equal(state0.master, master0)
        out[chunk] = params, state
    assert tree_equal(out[None][0], out[100][0]) and tree_equal(out[None][1], out[100][1])
    counts = [int(x) for x in optree.tree_leaves(out[100][1].tx_state) if x.dtype == torch.int32]
    assert counts and all(c == 4 for c in counts)  # 0-d state: advanced once per applied step, not per chunk


@pytest.mark.slow
@pytest.mark.parametrize("moments,donate", [(torch.bfloat16, False), (torch.int8, True)])
def test_low_precision_moments_compile_their_chunk_update_and_skip_the_same(moments, donate, monkeypatch):
    """From ``COMPILE_NUMEL`` shard elements (lowered here to 512), an eager step with BF16 or
    8-bit moments runs its chunks through one compiled update: the eager ops' results to float
    rounding (an 8-bit code at most one level away, rarely), bitwise whatever the chunking, every
    state bit kept on a skipped step; under a dispatch mode the same path, where torch.compile runs
    nothing compiled: the compiled update's function eagerly, the eager ops' bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    p0 = mlp.init(torch.Generator().manual_seed(0), (16, 64, 4))  # a shard of 1536 elements: 6 blocks
    grads_list = [optree.tree_map(lambda g: (g * 8).half(), grads_like(p0, i)) for i in range(4)]
    grads_list[2]["layers"][1]["w"][3, 1] = float("nan")  # step 3 is skipped
    tx = transforms.adamw(lr=1e-2, weight_decay=0.1, mu_dtype=moments, nu_dtype=moments)
    calls = []
    compiled = fzero.cpu.chunked.compiled_chunks
    monkeypatch.setattr(fzero.cpu.chunked, "compiled_chunks",
                        lambda *a, **kw: calls.append(kw["chunk"]) or compiled(*a, **kw))

    def train(compile_numel, chunk, mode=contextlib.nullcontext):
        monkeypatch.setattr(fzero.update, "COMPILE_NUMEL", compile_numel)
        engine = fzero.zero1(tx, param_dtype=torch.float16, loss_scale=fzero.StaticLossScale(8.0), donate=donate,
                             chunk_numel=chunk)
        params, state, ss = engine.init(p0)
        for i, grads in enumerate(grads_list):
            before = optree.tree_map(torch.clone, state)
            with mode():
                params, state, ss, info = engine.step(params, grads, state, ss)
            if i == 2:
                assert info["found_inf"] and tree_equal(state, before)
        return params, state

    eager = train(2**40, 256)
    assert calls == []
    by_256, by_768 = train(512, 256), train(512, 768)  # chunks of 256 (6), then of 768 (2)
    assert calls == [256] * 4 + [768] * 4
    assert tree_equal(by_256, by_768)
    assert tree_equal(train(512, 256, Passthrough), eager) and calls[8:] == [256] * 4
    tree_assert_close(by_256[0], eager[0], rtol=2e-3, atol=0)  # FP16 params: one FP16 step apart at most
    torch.testing.assert_close(by_256[1].master, eager[1].master, rtol=1e-6, atol=1e-7)
    assert_compiled_state_close(by_256[1].tx_state, eager[1].tx_state)


# ---------------------------------------------------------------- the fused AdamW path
def fused_and_generic(**adamw_kw):
    """The standard recipe (clip + AdamW with a schedule) and the same without its fused step."""
    tx = transforms.chain(transforms.clip_by_global_norm(2.0),
                          transforms.adamw(lr=transforms.warmup_cosine_decay(0.0, 1e-2, 2, 20), weight_decay=0.1, **adamw_kw))
    assert tx.fused is not None
    return tx, tx._replace(fused=None)


@pytest.fixture
def fused_calls(monkeypatch):
    """Count the calls of torch's fused AdamW kernel (a spy on torch, not on fzero)."""
    calls, kernel = [], torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(1), kernel(*a, **k))[1])
    return calls


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask", [None, lambda p: optree.tree_map(lambda x: x.ndim > 1, p)])
@pytest.mark.parametrize("kw", [dict(donate=True), dict(donate=False, simulate=(0, 2), bucket_bytes=64)])
def test_fused_adamw_step_equals_the_generic_step_and_skips_the_same(param_dtype, mask, kw, fused_calls):
    p0 = odd_params()
    scale = 2.0**8 if param_dtype == torch.float16 else 1.0
    seq = [optree.tree_map(lambda g: (g * scale).to(param_dtype), grads_like(p0, i)) for i in range(5)]
    seq[2] = optree.tree_map(lambda g: torch.full_like(g, float("inf")), seq[2])  # step 2 overflows on every rank: skipped
    results = []
    for tx in fused_and_generic(weight_decay_mask=mask):
        engine = fzero.zero1(tx, param_dtype=param_dtype, loss_scale=fzero.StaticLossScale(scale), **kw)
        params, state, ss = engine.init(p0)
        kept = [x.clone() for x in (state.master, state.tx_state[1][0].mu, state.tx_state[1][0].nu)]
        for i, g in enumerate(seq):
            before = optree.tree_map(torch.clone, state)
            params, state, ss, info = engine.step(params, g, state, ss)
            assert bool(info["found_inf"]) == (i == 2)
            if i == 2:  # a skipped step keeps every state tensor bitwise
                assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(before), optree.tree_leaves(state)))
            if i == 0 and not kw["donate"]:  # pure: the inputs are untouched
                assert all(torch.equal(a, b) for a, b in zip(kept, optree.tree_leaves(before)[:1] + [before.tx_state[1][0].mu, before.tx_state[1][0].nu]))
        results.append((params, state, info))
    assert len(fused_calls) == 5  # the first engine ran fused (the skipped step too: a no-op inside the kernel)
    (pf, sf, inf_f), (pg, sg, inf_g) = results
    for a, b in zip(optree.tree_leaves(sf), optree.tree_leaves(sg)):
        if a.is_floating_point() and a.ndim:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b)  # counts (4 applied updates of 5), masks, hyperparameters
    assert int(sf.tx_state[1][0].count) == 4
    tree_assert_close(pf, pg, rtol=1e-2 if param_dtype != torch.float32 else 1e-6, atol=1e-3 if param_dtype != torch.float32 else 1e-7)
    torch.testing.assert_close(inf_f["grad_norm"], inf_g["grad_norm"], rtol=1e-6, atol=0)


def test_fused_path_takes_new_hyperparameters_and_declines_without_host_values(fused_calls):
    p0 = odd_params()
    grads = optree.tree_map(lambda g: g.half(), grads_like(p0, 0))
    out = []
    for tx in fused_and_generic():
        engine = fzero.zero1(tx, param_dtype=torch.float16, loss_scale=None)
        params, state, ss = engine.init(p0)
        state = state._replace(tx_state=transforms.set_hyperparams(state.tx_state, b2=0.9, weight_decay=0.5))
        out.append(engine.step(params, grads, state, ss)[1].master)
    assert len(fused_calls) == 1
    torch.testing.assert_close(out[0], out[1], rtol=1e-6, atol=1e-7)
    # a hyperparameter made by arithmetic carries no host value: the generic update runs
    engine = fzero.zero1(fused_and_generic()[0], param_dtype=torch.float16, loss_scale=None)
    params, state, ss = engine.init(p0)
    adam = state.tx_state[1][0]
    state = state._replace(tx_state=(state.tx_state[0], (adam._replace(b2=adam.b2 * 1.0), *state.tx_state[1][1:])))
    master = engine.step(params, grads, state, ss)[1].master
    assert len(fused_calls) == 1
    torch.testing.assert_close(master, out[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_fused_step_at_world_size_one_reads_the_grad_leaves_and_writes_the_params_in_place(param_dtype):
    """Donated, the eager fused step allocates nothing shard-sized: the grads are read a chunk
    at a time straight from the leaves, the params are cast into their own buffer."""
    p0 = {"w": torch.randn(40, 33), "b": torch.randn(33), "v": torch.randn(7, 50)}
    tx = fused_and_generic(weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p))[0]
    engine = fzero.zero1(tx, param_dtype=param_dtype, loss_scale=None, donate=True, chunk_numel=256)
    params, state, ss = engine.init(p0)
    S, ptr = engine.layout.shard_numel, engine.flat_params(params).data_ptr()
    grads = optree.tree_map(lambda p: torch.randn(p.shape).to(param_dtype), params)
    params, state, ss, _ = engine.step(params, grads, state, ss)  # first call: one-time work
    with NewTensors() as new:
        params, state, ss, info = engine.step(params, grads, state, ss)
    assert max(new.numels) <= 256 < S and engine.flat_params(params).data_ptr() == ptr
    # the same step from the flat grads, on a copy of the state: bitwise the same, the norm too
    params2, state2, ss2 = engine.init(p0)
    params2 = engine.flat_params(params2)
    for _ in range(2):
        params2, state2, ss2, info2 = engine.step(params2, fzero.flatten(grads, engine.layout), state2, ss2)
    assert torch.equal(params2, engine.flat_params(params)) and tree_equal(state2, state)
    assert torch.equal(info2["grad_norm"], info["grad_norm"])


@pytest.mark.slow
def test_each_engine_compiles_its_chunks_apart_so_many_engines_never_hit_dynamos_recompile_limit(monkeypatch):
    """Dynamo allows a code object a limited number of graphs (8; 2 here: one engine's two chunk
    shapes), and the compiled chunk update is guarded on the transform's state: one compiled
    ``_update`` shared by every engine made the second engine here (8-bit moments after BF16
    ones) fail with ``fullgraph=True``, and by default one of the next few, as
    ``benchmarks/memory.py``'s moment rows did. Each engine's ``compiled_update()`` is a copy of
    the code with a cache of its own."""
    monkeypatch.setattr(fzero.update, "COMPILE_NUMEL", 512)
    p0 = mlp.init(torch.Generator().manual_seed(0), (16, 64, 4))  # chunks of 256 and a last one
    grads = optree.tree_map(lambda g: g.half(), grads_like(p0, 0))
    with torch._dynamo.config.patch(recompile_limit=2):
        for moments in (torch.bfloat16, torch.int8, torch.bfloat16):
            tx = transforms.adamw(lr=1e-2, mu_dtype=moments, nu_dtype=moments)
            engine = fzero.zero1(tx, param_dtype=torch.float16, loss_scale=None, chunk_numel=256)
            params, state, ss = engine.init(p0)
            _, new_state, _, _ = engine.step(params, grads, state, ss)
            assert not tree_equal(new_state, state)  # it stepped
