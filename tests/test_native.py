"""fzero's own CPU kernels (``fzero.native``): the AdamW update gives the same bits as the update
inductor compiles, in place, a skipped step, padding, BF16's ties-away rounding and the
saturation of the cast; the pure step and the transforms it cannot run keep inductor's loops.
The eager norm's sum of squares: the float64 sum, non-finite on any inf or NaN, the same bits
on any number of threads."""
import optree
import pytest
import torch
import torch._dynamo

import fzero
import fzero.leafwise
from fzero import native, transforms
from fzero.grads import Segments
from fzero.update import NORM_BLOCK, NORM_ROW, cast_params, compiled_update, sum_of_squares
from helpers import grads_like, grads_seq, odd_params

pytestmark = pytest.mark.skipif(not native.available(torch.device("cpu")),
                                reason="the CPU kernel could not be built here (no C++ compiler)")

DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture
def leaf_by_leaf_at_any_size(monkeypatch):
    monkeypatch.setattr(fzero.leafwise, "MIN_MEAN_NUMEL", 0)
    monkeypatch.setattr(fzero.leafwise, "MIN_NUMEL", 0)
    monkeypatch.setattr(fzero.leafwise, "NATIVE_MIN_NUMEL", 0)


def counted(monkeypatch) -> list:
    """The calls of ``native.adamw_update`` from here on, counted (each still runs)."""
    calls, kernel = [], native.adamw_update
    monkeypatch.setattr(native, "adamw_update", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    return calls


def train(p0, seq, param_dtype, *, flat, donate, use_native, monkeypatch, compiled=True, master="fp32"):
    """Steps of ``adamw`` with a warm-up schedule (lr a new value each step) over ``seq``,
    compiled (or eager), from the grads pytree (compiled: leaf by leaf, with the kernel or the
    compiled loops; FP32 params: with the kernel only) or (``flat``) from the flat buffer, the
    master kept as ``master`` says; returns ``(params as a pytree, state, infos)``."""
    torch._dynamo.reset()
    monkeypatch.setattr(native, "available", lambda device: use_native)
    scaling = fzero.DynamicLossScale(init_scale=2.0**10, growth_interval=2) if param_dtype == torch.float16 else None
    tx = transforms.adamw(lr=lambda count: 1e-2 * (count.double() + 1) / 4, weight_decay=0.1)
    engine = fzero.zero1(tx, param_dtype=param_dtype, loss_scale=scaling, donate=donate, bucket_bytes=48,
                         master=master)
    params, state, ss = engine.init(p0)
    assert engine._compiled_update.native == use_native
    assert (engine._compiled_update.leaves is not None) == (use_native and donate or param_dtype != torch.float32)
    step = torch.compile(engine.step, fullgraph=True) if compiled else engine.step
    carry = engine.flat_params(params) if flat else params
    infos = []
    for g in seq:
        carry, state, ss, info = step(carry, fzero.flatten(g, engine.layout) if flat else g, state, ss)
        infos.append(info)
    return (fzero.unflatten(carry, engine.layout) if flat else carry), state, infos


# Pure in BF16 only: its kernel call is the donated one on copies of master and moments, into new
# params (``cast_on_skip``, whose cast the edges test below takes in every dtype). FP32 params
# beside an FP32 master (written as its copy) and as the master itself (``master="params"``:
# leaf by leaf, the master is then the params' own buffer, checked before the kernel reads it).
@pytest.mark.parametrize("param_dtype,donate,master", [(torch.float16, True, "fp32"), (torch.bfloat16, True, "fp32"),
                                                       (torch.bfloat16, False, "fp32"), (torch.float32, True, "fp32"),
                                                       (torch.float32, True, "params")])
def test_kernel_equals_the_compiled_update_bitwise(param_dtype, donate, master, monkeypatch, leaf_by_leaf_at_any_size):
    """The compiled step from a grads pytree (leaf by leaf) and from the flat buffer with the
    kernel, and the eager step with it, against the compiled step on the flat buffer with
    inductor's loops (which ``test_leafwise.py`` holds bit for bit to the leaf-by-leaf loops):
    every param, the master, the moments and the count bit for bit, with padding between leaves
    (buckets), an inf that skips a step (pure: the new params the master's cast), and a learning
    rate that changes every step; the grad norm to 1e-6. The kernel runs once per step, eager or
    compiled and donated (the compiled pure step keeps inductor's loops: on the flat buffer here,
    leaf by leaf in test_leafwise.py)."""
    p0 = odd_params()
    seq = grads_seq(p0, param_dtype, 2.0**10 if param_dtype == torch.float16 else 1.0)
    calls = counted(monkeypatch)
    runs = {}
    for flat in (False, True):
        # pure, leaf by leaf: inductor's loops, held to the flat step's by test_leafwise.py
        for use_native in (False, True) if flat else (True,) if donate else ():
            before = len(calls)
            runs[flat, use_native] = train(p0, seq, param_dtype, flat=flat, donate=donate, use_native=use_native,
                                           monkeypatch=monkeypatch, master=master)
            assert len(calls) - before == (len(seq) if use_native and donate else 0)
        before = len(calls)
        runs[flat, "eager"] = train(p0, seq, param_dtype, flat=flat, donate=donate, use_native=True,
                                    monkeypatch=monkeypatch, compiled=False, master=master)
        assert len(calls) - before == len(seq)
    want = runs[True, False]
    norms = lambda run: torch.stack([i["grad_norm"] for i in run[2]])  # noqa: E731
    for got in runs.values():
        assert [bool(i["found_inf"]) for i in got[2]] == [bool(i["found_inf"]) for i in want[2]] == [
            False, False, True, False, False]
        # the norm in rows of its own where the kernel takes it (eager, and leaf by leaf: fzero.native)
        torch.testing.assert_close(norms(got), norms(want), rtol=1e-6, atol=0, equal_nan=True)
        for a, b in zip(optree.tree_leaves(got[:2]), optree.tree_leaves(want[:2])):
            assert a.dtype == b.dtype and torch.equal(a, b)


def edge_master(param_dtype) -> torch.Tensor:
    """FP32 master values where the cast has its edges: exact BF16 ties (each sign, low bits
    0x8000 over even and odd kept bits), beyond each dtype's range, FP32's largest, zeros of
    each sign, subnormals, and ordinary values."""
    bits = torch.tensor([0x3F808000, 0x3F818000, -0x40000000 + 0x8000, 0x7F7FFFFF, 0x7F7F8000, 0x00000001,
                         0x00018000, 0x00000000], dtype=torch.int32)
    special = torch.cat([bits.view(torch.float32), torch.tensor([-0.0, 7e4, -7e4, 65504.0, 65519.0, 65520.0,
                                                                  -3.4e38, 1.0, -2.5])])
    return torch.cat([special, torch.randn(1000, generator=torch.Generator().manual_seed(1))])


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("param_dtype", [*DTYPES, torch.float32])
def test_kernel_equals_the_compiled_update_at_the_casts_edges(param_dtype, skip):
    """``adamw_update`` on a shard with gaps between its grad pieces (padding: zero grads) and
    master values at the cast's edges, against the compiled ``_update`` of the same transform on
    the grads (FP16, BF16 or FP32, as the params) times the mean factor: the master, both
    moments and the params, bit for bit (eager, torch's ``sqrt`` on a CPU may differ from the
    correctly rounded one by an ulp); FP32 params also as the master itself (no params given).
    A skipped step writes nothing."""
    master = edge_master(param_dtype)
    S = master.numel()
    tx = transforms.adamw(lr=1e-3, weight_decay=0.1)
    state = tx.init(master)
    gen = torch.Generator().manual_seed(2)
    state = (state[0]._replace(mu=torch.randn(S, generator=gen) * 1e-3, nu=torch.rand(S, generator=gen) * 1e-6,
                               count=torch.tensor(4, dtype=torch.int32)), *state[1:])
    grads = (torch.randn(S, generator=gen) * 100).to(param_dtype)
    grads[3:10] = 0  # a gap: no piece holds these elements
    pieces, starts = [grads[10:500], grads[:3], grads[500:]], [10, 0, 500]
    mean_factor, skip_t = torch.tensor(1 / 64.0), torch.tensor(skip)

    torch._dynamo.reset()
    want_master, want_state, want_params = compiled_update().whole(tx, grads.float() * mean_factor, master, state, skip_t,
                                                   torch.tensor(1.0, dtype=torch.float64), param_dtype)
    mu, nu = state[0].mu.clone(), state[0].nu.clone()
    m0 = master.clone()
    params = cast_params(master, param_dtype, copy=True)
    fused = tx.fused(state, grad_scale=torch.tensor(1.0), found_inf=skip_t, grad_norm=torch.tensor(1.0))
    if param_dtype == torch.float32:  # the FP32 params as the master: updated in place, nothing else written
        as_master, mu2, nu2 = master.clone(), mu.clone(), nu.clone()
        native.adamw_update(pieces, starts, fused.adamw(), mean_factor, skip_t, as_master, mu2, nu2, None)
        for got, want in ((as_master, want_master), (mu2, want_state[0].mu), (nu2, want_state[0].nu)):
            assert torch.equal(got.view(torch.int8), want.view(torch.int8))
    native.adamw_update(pieces, starts, fused.adamw(), mean_factor, skip_t, m0, mu, nu, params)
    for got, want in ((m0, want_master), (mu, want_state[0].mu), (nu, want_state[0].nu), (params, want_params)):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.int8), want.view(torch.int8))
    assert int(fused.state[0].count) == (4 if skip else 5)
    if skip:  # into new params (the pure step): it writes them, the master's cast, and nothing else
        fresh, before = torch.zeros_like(params), [x.clone() for x in (m0, mu, nu)]
        native.adamw_update(pieces, starts, fused.adamw(), mean_factor, skip_t, m0, mu, nu, fresh, cast_on_skip=True)
        assert torch.equal(fresh.view(torch.int8), want_params.view(torch.int8))
        assert all(torch.equal(a, b) for a, b in zip(before, (m0, mu, nu)))


def test_a_transform_it_cannot_run_never_calls_it(monkeypatch, leaf_by_leaf_at_any_size):
    """Clipping before AdamW (the grads times a factor the kernel does not take), a decay mask
    or BF16 moments: ``update.native_fused`` declines each, and the step runs torch's kernel or
    inductor's loops, never this one: eager for all three, and compiled from a grads pytree (leaf
    by leaf) and from the flat buffer for clipping, the one whose state the kernel could take
    (both compiled paths ask the same ``native_fused``)."""
    calls = counted(monkeypatch)
    p0 = odd_params()
    seq = grads_seq(p0, torch.bfloat16, 1.0, n=2, bad_step=None)
    clipped = transforms.chain(transforms.clip_by_global_norm(1.0), transforms.adamw(lr=1e-2))
    for tx, compiled in ((clipped, False), (clipped, True),
                         (transforms.adamw(lr=1e-2, weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p)),
                          False),
                         (transforms.adamw(lr=1e-2, mu_dtype=torch.bfloat16), False)):
        torch._dynamo.reset()
        engine = fzero.zero1(tx, param_dtype=torch.bfloat16, loss_scale=None, donate=True)
        params, state, ss = engine.init(p0)
        assert engine._compiled_update.native  # the kernel is there: the transform declines it
        step = torch.compile(engine.step, fullgraph=True) if compiled else engine.step
        flat = engine.flat_params(params)
        for g in seq:
            params, state, ss, _ = step(params, g, state, ss)
        assert bool(engine._compiled_update.leaves._compiled) == compiled  # leaf by leaf: compiled only
        for g in seq:
            flat, state, ss, _ = step(flat, fzero.flatten(g, engine.layout), state, ss)
    assert calls == []


def test_where_it_runs_the_update_the_models_size_alone_picks_leaf_by_leaf(monkeypatch):
    """Where the kernel runs the update (``leafwise.native_runs``: AdamW with FP32 moments, no
    clipping), the compiled step from a grads pytree runs it leaf by leaf from
    ``NATIVE_MIN_NUMEL`` elements however small the leaves (the 4 leaves here hold 14 on
    average, far below ``MIN_MEAN_NUMEL``), donated; a transform it declines, and the pure step
    (whose update leaf by leaf runs inductor's loops), keep to those loops' bounds and stay in
    the step's graph."""
    p0 = odd_params()  # 55 elements in 4 leaves
    adamw = transforms.adamw(lr=1e-2)
    clipped = transforms.chain(transforms.clip_by_global_norm(1.0), transforms.adamw(lr=1e-2))
    for tx, donate, native_min, leaf_by_leaf in ((adamw, True, 55, True), (adamw, True, 56, False),
                                                 (clipped, True, 0, False), (adamw, False, 0, False)):
        monkeypatch.setattr(fzero.leafwise, "NATIVE_MIN_NUMEL", native_min)
        engine = fzero.zero1(tx, param_dtype=torch.bfloat16, loss_scale=None, donate=donate)
        engine.init(p0)
        assert (engine._compiled_update.leaves is not None) == leaf_by_leaf, (tx, native_min)
    assert fzero.leafwise.MIN_MEAN_NUMEL * 4 > 55


@pytest.mark.parametrize("param_dtype,master", [(torch.bfloat16, "fp32"), (torch.float32, "params")])
def test_leaf_by_leaf_params_outside_their_buffer_raise_before_the_kernel_writes(param_dtype, master,
                                                                                 leaf_by_leaf_at_any_size):
    """Compiled from a grads pytree, the kernel casts into the params' own buffer (FP32 params
    with ``master="params"``: updates it, as the master): params that are not views of it (each
    leaf its own memory) raise a clear error, and the state and both sets of params keep every
    bit; the engine's params then step."""
    p0 = odd_params()
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=param_dtype, loss_scale=None, donate=True,
                         master=master)
    params, state, ss = engine.init(p0)
    grads = optree.tree_map(lambda x: x.to(param_dtype), grads_like(p0, 0))
    torch._dynamo.reset()
    step = torch.compile(engine.step, fullgraph=True)
    cloned = optree.tree_map(lambda x: x.clone(), params)
    before = optree.tree_map(lambda x: x.clone(), (state, params, cloned))
    with pytest.raises(ValueError, match="params are not views of one flat buffer"):
        step(cloned, grads, state, ss)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves((state, params, cloned)),
                                                 optree.tree_leaves(before)))
    step(params, grads, state, ss)
    assert not torch.equal(params["w"], before[1]["w"]) and not torch.equal(state.tx_state[0].mu, before[0].tx_state[0].mu)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sum_of_squares_is_the_float64_sum_on_any_number_of_threads(dtype):
    """The kernel's sum of squares of pieces with partial rows (tails that fill no row) and
    more than one block, against the float64 sum of the squares and the eager ``sum_of_squares``
    without the kernel, in FP32 rows (``bounded``) and float64 rows; the same bits on 1 and 2
    threads."""
    gen = torch.Generator().manual_seed(3)
    g = (torch.randn(NORM_BLOCK + 70000, generator=gen) * 300).to(dtype)
    cuts = (0, 1000, 1300, 1300 + NORM_BLOCK, g.numel())
    seg = Segments(tuple(g[a:b] for a, b in zip(cuts, cuts[1:])), cuts[:-1], g.numel(), False)
    want = g.double().square().sum()
    threads = torch.get_num_threads()
    for bounded in (True, False):
        got = sum_of_squares(seg, bounded=bounded, native=True)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
        torch.testing.assert_close(got, sum_of_squares(seg, bounded=bounded), rtol=2e-6, atol=0)
        try:
            torch.set_num_threads(1 if threads > 1 else 2)
            assert torch.equal(sum_of_squares(seg, bounded=bounded, native=True), got)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sum_of_squares_spans_the_range_and_is_non_finite_on_any_inf_or_nan(dtype):
    """In float64 rows: the dtype's largest values squared (beyond FP32) and its smallest
    subnormals (whose squares FP32 flushes) are summed exactly enough; an inf, in a full row or
    in a tail, gives inf and a NaN gives NaN."""
    info = torch.finfo(dtype)
    g = torch.cat([torch.full((300,), info.max), torch.full((20,), info.smallest_normal * info.eps)]).to(dtype)
    seg = Segments.of(g, False)
    torch.testing.assert_close(sum_of_squares(seg, bounded=False, native=True), g.double().square().sum(), rtol=1e-6,
                               atol=0)
    tiny = Segments.of(g[300:], False)
    assert sum_of_squares(tiny, bounded=False, native=True) == g[300:].double().square().sum()
    for at in (5, 310):  # a full row, the zero-padded tail
        for bad, check in ((float("inf"), torch.isinf), (float("nan"), torch.isnan)):
            h = torch.ones(320, dtype=dtype)
            h[at] = bad
            for bounded in (True, False):
                assert check(sum_of_squares(Segments.of(h, False), bounded=bounded, native=True))


@pytest.mark.parametrize("param_dtype", DTYPES)
def test_the_eager_norm_runs_the_kernel(param_dtype, monkeypatch):
    """The eager pure step with the kernel's norm and without (clipping at a norm never reached
    before AdamW: torch's fused AdamW either way): the same params, master and moments bit for
    bit, the same skipped step (an inf), grad norms within FP32's rounding; the kernel once per
    step."""
    gen = torch.Generator().manual_seed(4)
    p0 = {"w": torch.randn(300, 7, generator=gen), "b": torch.randn(1000, generator=gen), "c": torch.randn(5, generator=gen)}
    seq = []
    for i in range(3):
        seq.append(optree.tree_map(lambda x: (x * 2.0**8).to(param_dtype), grads_like(p0, i)))
    seq[1]["w"][4, 2] = float("inf")
    calls, kernel = [], native.sum_of_squares
    monkeypatch.setattr(native, "sum_of_squares", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    runs = []
    for use_native in (True, False):
        monkeypatch.setattr(native, "available", lambda device: use_native)
        scaling = fzero.DynamicLossScale(init_scale=2.0**8) if param_dtype == torch.float16 else None
        tx = transforms.chain(transforms.clip_by_global_norm(1e30), transforms.adamw(lr=1e-2, weight_decay=0.1))
        engine = fzero.zero1(tx, param_dtype=param_dtype, loss_scale=scaling)
        params, state, ss = engine.init(p0)
        infos = []
        for g in seq:
            params, state, ss, info = engine.step(params, g, state, ss)
            infos.append(info)
        runs.append((params, state, infos))
    assert len(calls) == len(seq)
    (p1, s1, i1), (p2, s2, i2) = runs
    assert [bool(i["found_inf"]) for i in i1] == [bool(i["found_inf"]) for i in i2] == [False, True, False]
    for a, b in zip(optree.tree_leaves((p1, s1)), optree.tree_leaves((p2, s2))):
        assert torch.equal(a, b)
    for a, b in zip(i1, i2):
        torch.testing.assert_close(a["grad_norm"], b["grad_norm"], rtol=1e-6, atol=0, equal_nan=True)
