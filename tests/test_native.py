"""fzero's own CPU kernels (``fzero.cpu.native``): the AdamW update gives the same bits as the update
inductor compiles, in place, a skipped step, padding, BF16's ties-away rounding and the
saturation of the cast; the pure step and the transforms it cannot run keep inductor's loops.
The eager norm's sum of squares: the float64 sum, non-finite on any inf or NaN, the same bits
on any number of threads. The build and its cache: a lock held past the timeout, a damaged
library, and builds killed midway never crash or hang a later process."""
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import warnings

import optree
import pytest
import torch
import torch._dynamo
import torch.utils.cpp_extension

import fzero
import fzero.cpu.leafwise
from fzero import transforms
from fzero.cpu import native
from fzero.cpu.kernel import native_sum_of_squares
from fzero.grad_forms import Segments
from fzero.cast import cast_params
from fzero.norm import NORM_BLOCK, NORM_ROW, sum_of_squares
from fzero.update import compiled_update
from distributed import require_tier
from helpers import grads_like, grads_seq, odd_params

pytestmark = pytest.mark.skipif(not native.available(torch.device("cpu")),
                                reason="the CPU kernel could not be built here (no C++ compiler)")

DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture
def leaf_by_leaf_at_any_size(monkeypatch):
    monkeypatch.setattr(fzero.cpu.leafwise, "MIN_MEAN_NUMEL", 0)
    monkeypatch.setattr(fzero.cpu.leafwise, "MIN_NUMEL", 0)
    monkeypatch.setattr(fzero.cpu.leafwise, "NATIVE_MIN_NUMEL", 0)


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
    assert engine._kernels.native == use_native
    assert (engine._kernels.leaves is not None) == (use_native and donate or param_dtype != torch.float32)
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
@pytest.mark.slow
@pytest.mark.parametrize("param_dtype,donate,master", [(torch.float16, True, "fp32"), (torch.bfloat16, True, "fp32"),
                                                       (torch.bfloat16, False, "fp32"), (torch.float32, True, "fp32"),
                                                       (torch.float32, True, "params")])
def test_kernel_equals_the_kernels_bitwise(param_dtype, donate, master, monkeypatch, leaf_by_leaf_at_any_size):
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
        # the norm in rows of its own where the kernel takes it (eager, and leaf by leaf: fzero.cpu.native)
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
def test_kernel_equals_the_kernels_at_the_casts_edges(param_dtype, skip):
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
        native.adamw_update(pieces, starts, native.pack(fused.adamw()), mean_factor, skip_t, as_master, mu2, nu2, None)
        for got, want in ((as_master, want_master), (mu2, want_state[0].mu), (nu2, want_state[0].nu)):
            assert torch.equal(got.view(torch.int8), want.view(torch.int8))
    native.adamw_update(pieces, starts, native.pack(fused.adamw()), mean_factor, skip_t, m0, mu, nu, params)
    for got, want in ((m0, want_master), (mu, want_state[0].mu), (nu, want_state[0].nu), (params, want_params)):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.int8), want.view(torch.int8))
    assert int(fused.state[0].count) == (4 if skip else 5)
    if skip:  # into new params (the pure step): it writes them, the master's cast, and nothing else
        fresh, before = torch.zeros_like(params), [x.clone() for x in (m0, mu, nu)]
        native.adamw_update(pieces, starts, native.pack(fused.adamw()), mean_factor, skip_t, m0, mu, nu, fresh, cast_on_skip=True)
        assert torch.equal(fresh.view(torch.int8), want_params.view(torch.int8))
        assert all(torch.equal(a, b) for a, b in zip(before, (m0, mu, nu)))


@pytest.mark.slow
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
        assert engine._kernels.native  # the kernel is there: the transform declines it
        step = torch.compile(engine.step, fullgraph=True) if compiled else engine.step
        flat = engine.flat_params(params)
        for g in seq:
            params, state, ss, _ = step(params, g, state, ss)
        assert bool(engine._kernels.leaves._compiled) == compiled  # leaf by leaf: compiled only
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
        monkeypatch.setattr(fzero.cpu.leafwise, "NATIVE_MIN_NUMEL", native_min)
        engine = fzero.zero1(tx, param_dtype=torch.bfloat16, loss_scale=None, donate=donate)
        engine.init(p0)
        assert (engine._kernels.leaves is not None) == leaf_by_leaf, (tx, native_min)
    assert fzero.cpu.leafwise.MIN_MEAN_NUMEL * 4 > 55


@pytest.mark.slow
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
        got = native_sum_of_squares(seg, bounded=bounded)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
        torch.testing.assert_close(got, sum_of_squares(seg, bounded=bounded), rtol=2e-6, atol=0)
        try:
            torch.set_num_threads(1 if threads > 1 else 2)
            assert torch.equal(native_sum_of_squares(seg, bounded=bounded), got)
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
    torch.testing.assert_close(native_sum_of_squares(seg, bounded=False), g.double().square().sum(), rtol=1e-6,
                               atol=0)
    tiny = Segments.of(g[300:], False)
    assert native_sum_of_squares(tiny, bounded=False) == g[300:].double().square().sum()
    for at in (5, 310):  # a full row, the zero-padded tail
        for bad, check in ((float("inf"), torch.isinf), (float("nan"), torch.isnan)):
            h = torch.ones(320, dtype=dtype)
            h[at] = bad
            for bounded in (True, False):
                assert check(native_sum_of_squares(Segments.of(h, False), bounded=bounded))


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


# The build and its cache. In process: a cache under tmp_path, torch's build replaced where one would
# run (the kernels are loaded in this process already: a second library of the same ops cannot be).


@pytest.fixture
def cache(tmp_path, monkeypatch) -> native._Files:
    """The kernels' files under an empty ``TORCH_EXTENSIONS_DIR`` in ``tmp_path``."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("FZERO_NATIVE_BUILD_TIMEOUT", raising=False)
    files = native._files()
    os.makedirs(os.path.dirname(files.lock))
    return files


def cached(files: native._Files, library: bytes) -> None:
    """``library`` as the cached library, with its record (as a build leaves them)."""
    with open(files.library, "wb") as f:
        f.write(library)
    with open(files.record, "w") as f:
        json.dump(native._digest(files.library), f)


def test_a_lock_held_past_the_timeout_falls_back_with_one_warning_that_names_it(cache, monkeypatch):
    """While another process holds the build's lock (an flock, here on a descriptor of this
    process's own) the kernels wait ``FZERO_NATIVE_BUILD_TIMEOUT`` seconds, then are not
    available: one warning of one line that names the lock file, its holder and the ways out,
    nothing built or loaded; once the lock is free, the whole cached library is loaded."""
    monkeypatch.setenv("FZERO_NATIVE_BUILD_TIMEOUT", "0.3")
    cached(cache, b"a library")
    loads = []
    monkeypatch.setattr(torch.ops, "load_library", loads.append)
    monkeypatch.setattr(native, "_build", lambda files: pytest.fail("built"))
    fd = os.open(cache.lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242 elsewhere\n")
        start = time.monotonic()
        with pytest.warns(RuntimeWarning) as caught:
            assert native._module.__wrapped__() is None
        assert 0.3 <= time.monotonic() - start < 30  # bounded (a loaded machine may lag)
    finally:
        os.close(fd)
    [warning] = caught
    message = str(warning.message)
    assert "\n" not in message and loads == []
    for part in (cache.lock, "process 4242 on elsewhere", "FZERO_NATIVE_BUILD_TIMEOUT=", "FZERO_NATIVE=0"):
        assert part in message
    assert native._module.__wrapped__() is torch.ops.fzero_native and loads == [cache.library]


@pytest.mark.parametrize("seconds", ["-1", "soon", "nan"])
def test_a_build_timeout_that_is_no_number_of_seconds_raises(seconds, cache, monkeypatch):
    """A negative or unreadable ``FZERO_NATIVE_BUILD_TIMEOUT`` is one error that names it."""
    monkeypatch.setenv("FZERO_NATIVE_BUILD_TIMEOUT", seconds)
    with pytest.raises(ValueError, match=f"FZERO_NATIVE_BUILD_TIMEOUT='{seconds}'"):
        native._module.__wrapped__()


@pytest.mark.parametrize("damage,why", [("truncated", "700 bytes where 1500 were built"),
                                        ("a byte changed", "its sha256 differs from the built one's"),
                                        ("no record", "no record of it"), ("a record cut short", "no record of it"),
                                        ("absent", None)])
def test_a_damaged_cached_library_is_rebuilt_never_loaded(damage, why, cache, monkeypatch):
    """A cached library unlike its record (cut short, as a killed copy or a full disk leaves it;
    a byte changed; no record, or one cut short, as a build killed between its two renames leaves
    it) is never loaded: warned of once, rebuilt in a new directory after the directories of
    killed builds (torch's ``lock`` file in them) are removed, renamed into place with its new
    record. An absent one is built without a word."""
    cached(cache, b"the old library" * 100)
    if damage == "truncated":
        os.truncate(cache.library, 700)
    elif damage == "a byte changed":
        with open(cache.library, "r+b") as f:
            f.write(b"T")
    elif damage == "a record cut short":
        os.truncate(cache.record, 10)
    else:
        os.remove(cache.record if damage == "no record" else cache.library)
    killed = cache.library[:-len(".so")] + ".build-killed"
    os.makedirs(killed)
    open(os.path.join(killed, "lock"), "w").close()
    builds = []

    def build(name, sources, build_directory, **kw):  # torch's: the library, loaded, in its build directory
        assert not os.path.exists(killed) and os.listdir(build_directory) == []
        builds.append(build_directory)
        with open(os.path.join(build_directory, name + ".so"), "wb") as f:
            f.write(b"the new library")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: pytest.fail(f"loaded {path}"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native._module.__wrapped__() is torch.ops.fzero_native
    assert [str(w.message) for w in caught] == ([] if why is None else [
        f"fzero.cpu.native: the cached CPU kernels {cache.library} are damaged ({why}); rebuilding them"])
    assert len(builds) == 1 and not os.path.exists(builds[0])
    with open(cache.library, "rb") as f:
        assert f.read() == b"the new library"
    with open(cache.record) as f:
        assert json.load(f) == native._digest(cache.library)
    assert sorted(os.listdir(os.path.dirname(cache.lock))) == sorted(
        os.path.basename(p) for p in (cache.lock, cache.library, cache.record))


# In processes of their own, each with a new TORCH_EXTENSIONS_DIR: two builds in all.

# Says whether the kernels are available and runs one. Where ``pause``, it prints the build's
# directory once torch's own lock in it is taken (its FileBaton: a killed build leaves the file
# behind, and a cpp_extension.load of that directory waits on it forever), and waits to be killed.
BUILD = """
import signal, torch
from torch.utils import file_baton
from fzero.cpu import native
acquire = file_baton.FileBaton.try_acquire
def announced(self):
    got = acquire(self)
    if got and {pause}:
        print(self.lock_file_path, flush=True)
        signal.pause()
    return got
file_baton.FileBaton.try_acquire = announced
print(native.available(torch.device("cpu")), native.sum_of_squares([torch.arange(300.0)], 256, wide=True).item())
"""

# What BUILD prints where the kernels run: sum(i * i for i in range(300)).
BUILT = ["True", "8955050.0"]


def python_env(cache_root) -> dict:
    """The environment of a process whose kernels are cached under ``cache_root``."""
    require_tier("e2e", "starts Python processes that build fzero's kernels")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FZERO_NATIVE")}
    return env | {"TORCH_EXTENSIONS_DIR": str(cache_root), "OMP_NUM_THREADS": "1", "FZERO_NATIVE_BUILD_TIMEOUT": "60"}


def built(cache_root) -> subprocess.CompletedProcess:
    """BUILD run to its end in a new process, in 240 s at most (killed past them)."""
    return subprocess.run([sys.executable, "-c", BUILD.format(pause=False)], env=python_env(cache_root),
                          capture_output=True, text=True, timeout=240)


def killed_in_its_build(cache_root, sig) -> str:
    """The build directory of a new process that is killed with ``sig`` in its build (holding
    torch's lock in that directory, and fzero's on the cache), once it gets there (60 s at most)."""
    proc = subprocess.Popen([sys.executable, "-c", BUILD.format(pause=True)], env=python_env(cache_root),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        lock = proc.stdout.readline().strip() if ready else ""
    finally:
        if lock and proc.poll() is None:
            proc.send_signal(sig)
        else:  # it never got there: it ended, or it waits (a lock nobody will release)
            proc.kill()
        _, err = proc.communicate(timeout=60)
    assert lock, f"no build began in 60 s: {err[-3000:]}"
    assert proc.returncode == -sig and os.path.exists(lock)  # torch's lock, left behind
    return os.path.dirname(lock)


@pytest.mark.e2e
def test_a_build_killed_by_sigterm_or_sigkill_holds_no_later_process(tmp_path):
    """A process killed by SIGTERM (torchrun, ``timeout``, Slurm) in its build leaves torch's
    lock in its build directory; the next process takes fzero's lock at once (the kernel dropped
    it), removes that directory and builds in one of its own, and is killed there by SIGKILL; a
    third builds the kernels and runs them within a bound, without a warning, and leaves the
    library, its record and the lock file only."""
    first = killed_in_its_build(tmp_path, signal.SIGTERM)
    second = killed_in_its_build(tmp_path, signal.SIGKILL)
    assert not os.path.exists(first) and second != first
    proc = built(tmp_path)
    assert proc.returncode == 0 and "fzero.cpu.native" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.split() == BUILT
    name = native._files().name
    assert sorted(os.listdir(tmp_path / "fzero_native")) == [name + ext for ext in (".json", ".lock", ".so")]


@pytest.mark.e2e
def test_a_truncated_cached_library_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    """The kernels this process loaded, copied into a new cache with their record and cut to
    half their size (a copy killed or a disk full): a new process reads it, warns that it is
    damaged, rebuilds it and runs it (where loading it would end the process with SIGBUS, exit
    135); the cache then holds the whole library."""
    loaded = native._files()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    files = native._files()
    os.makedirs(os.path.dirname(files.lock))
    shutil.copyfile(loaded.record, files.record)
    with open(loaded.library, "rb") as f, open(files.library, "wb") as g:
        g.write(f.read()[:os.path.getsize(loaded.library) // 2])
    proc = built(tmp_path)
    assert proc.returncode == 0 and proc.stdout.split() == BUILT, proc.stderr[-3000:]
    assert f"the cached CPU kernels {files.library} are damaged" in proc.stderr
    with open(files.record) as f:
        assert json.load(f) == native._digest(files.library)
