"""torch.compile(engine.step, fullgraph=True): equal to eager, compiled once, no host syncs."""
import warnings

import optree
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import fzero
from fzero import transforms
from distributed import run_ranks
from helpers import assert_compiled_state_close, compiled_buffers, forbid_host_syncs, grads_like, grads_seq, odd_params


def tx():
    return transforms.chain(
        transforms.clip_by_global_norm(5.0),
        transforms.adamw(lr=1e-2, weight_decay=0.1, weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p)),
    )


def run(step, engine, p0, seq, *, lr_at=None):
    params, state, ss = engine.init(p0)
    infos = []
    for i, g in enumerate(seq):
        if i == lr_at:
            state = transforms.set_hyperparams(state, lr=3e-2)
        params, state, ss, info = step(params, g, state, ss)
        infos.append(info)
    return params, state, ss, infos


# The update in the step's graph, as it runs for small leaves and on a GPU. A CPU's compiled step
# runs large leaves' update leaf by leaf: tests/test_leafwise.py holds it to this path's bits.
@pytest.mark.slow
@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_compiled_step_equals_eager_and_never_recompiles(param_dtype):
    p0 = odd_params()
    scaling = fzero.DynamicLossScale(init_scale=2.0**10, growth_interval=2) if param_dtype == torch.float16 else None
    seq = grads_seq(p0, param_dtype, 2.0**10 if scaling else 1.0)
    seq[4]["blocks"][0]["g"][3] = float("nan")  # an inf at step 2, a NaN here: the norm inf, then NaN
    eager = fzero.zero1(tx(), param_dtype=param_dtype, loss_scale=scaling)
    e_params, e_state, e_ss, e_infos = run(eager.step, eager, p0, seq, lr_at=3)

    torch._dynamo.reset()
    counters.clear()
    engine = fzero.zero1(tx(), param_dtype=param_dtype, loss_scale=scaling, donate=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        c_params, c_state, c_ss, c_infos = run(torch.compile(engine.step, fullgraph=True), engine, p0, seq, lr_at=3)
    # one graph served every step: the loss scale changed (backoff, growth) and so did lr
    assert engine._kernels.leaves is None and counters["stats"]["unique_graphs"] == 1
    assert [bool(i["found_inf"]) for i in c_infos] == [bool(i["found_inf"]) for i in e_infos] == [False, False, True, False, True]
    assert len({float(i["loss_scale"]) for i in c_infos}) > 1 or scaling is None
    for a, b in zip(optree.tree_leaves((c_state, c_ss)), optree.tree_leaves((e_state, e_ss))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(optree.tree_leaves(c_params), optree.tree_leaves(e_params)):
        torch.testing.assert_close(a, b, rtol=1e-2 if param_dtype == torch.bfloat16 else 1e-3, atol=0)


@pytest.mark.slow
def test_compiled_step_with_8_bit_moments_equals_eager_and_never_recompiles():
    """One graph; the compiled update may round the FP32 moments differently in the last bit,
    which moves a stored code by at most one level."""
    moments = torch.int8
    p0 = odd_params()
    seq = grads_seq(p0, torch.bfloat16, 1.0)
    adamw = lambda: transforms.adamw(lr=1e-2, weight_decay=0.1, mu_dtype=moments, nu_dtype=moments)  # noqa: E731
    eager = fzero.zero1(adamw(), param_dtype=torch.bfloat16)
    e = run(eager.step, eager, p0, seq, lr_at=3)
    torch._dynamo.reset()
    counters.clear()
    engine = fzero.zero1(adamw(), param_dtype=torch.bfloat16, donate=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        c = run(torch.compile(engine.step, fullgraph=True), engine, p0, seq, lr_at=3)
    assert counters["stats"]["unique_graphs"] == 1
    assert [bool(i["found_inf"]) for i in c[3]] == [False, False, True, False, False]
    torch.testing.assert_close(c[1].master, e[1].master, rtol=1e-6, atol=1e-7)
    assert_compiled_state_close(c[1].tx_state, e[1].tx_state)


@pytest.mark.slow
def test_compiled_step_with_8_bit_moments_holds_no_fp32_moments():
    """The new FP32 moments are needed by two loops (each block's largest magnitude, then the
    encode and the update): recomputed in the second, not stored in between (``scale_by_adam``).
    A stored pair is two FP32 buffers of the shard's size, 8 B/elem more of memory, 16 of traffic."""
    engine = fzero.zero1(transforms.adamw(lr=1e-2, mu_dtype=torch.int8, nu_dtype=torch.int8),
                         param_dtype=torch.float16, loss_scale=fzero.DynamicLossScale(), donate=True)
    params, state, ss = engine.init(odd_params())
    grads = optree.tree_map(lambda p: torch.randn_like(p, dtype=torch.float32).half(), params)
    _, buffers = compiled_buffers(torch.compile(engine.step, fullgraph=True), params, grads, state, ss)
    S = engine.layout.shard_numel
    assert (S, "float16") in buffers  # the probe sees the shard's buffers: the grads laid out
    assert (S, "float32") not in buffers, buffers


def compiled_vs_eager(rank, world_size):
    p0 = odd_params()
    seq = [optree.tree_map(lambda x: (x * 64).half(), grads_like(p0, 10 * i + rank)) for i in range(3)]
    eager = fzero.zero1(tx(), param_dtype=torch.float16, loss_scale=fzero.StaticLossScale(64.0))
    compiled = fzero.zero1(tx(), param_dtype=torch.float16, loss_scale=fzero.StaticLossScale(64.0), donate=True)
    e = run(eager.step, eager, p0, seq)
    c = run(torch.compile(compiled.step, fullgraph=True), compiled, p0, seq)
    # A second engine with another layout in the same process: dynamo recompiles the same code
    # and may trace the layout's ints as symbols (automatic dynamic); the step must still trace.
    p1 = {"a": torch.randn(300), "b": torch.randn(7, 9)}
    other = fzero.zero1(tx(), param_dtype=torch.float16, loss_scale=None, bucket_bytes=256)
    seq1 = [optree.tree_map(lambda x: x.half(), grads_like(p1, i)) for i in range(2)]
    o = run(torch.compile(other.step, fullgraph=True), other, p1, seq1)
    o_eager = run(other.step, other, p1, seq1)
    torch.testing.assert_close(o[1].master, o_eager[1].master, rtol=1e-6, atol=1e-7)
    out = {"eager": optree.tree_leaves(e[1]), "compiled": optree.tree_leaves(c[1]),
           "params": fzero.flatten(c[0], compiled.layout)}
    # The compiled graphs (still cached by dynamo) must not hold the ProcessGroup: shutdown
    # would warn that its backend threads outlive it.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fzero.shutdown()
    return out


@pytest.mark.multirank
def test_compiled_step_on_two_gloo_ranks_equals_eager():
    out = run_ranks(compiled_vs_eager, 2)
    assert torch.equal(out[0]["params"], out[1]["params"])
    for r in out:
        for a, b in zip(r["compiled"], r["eager"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_forbid_host_syncs_catches_a_sync():
    with pytest.raises(AssertionError, match="Tensor.item"):
        with forbid_host_syncs():
            torch.ones(()).item()


@pytest.mark.parametrize("donate", [False, True])
def test_step_and_accumulate_make_no_host_sync(donate):
    p0 = odd_params()
    engine = fzero.zero1(tx(), param_dtype=torch.float16, donate=donate, loss_scale=fzero.DynamicLossScale(2.0**8))
    params, state, ss = engine.init(p0)
    seq = grads_seq(p0, torch.float16, 2.0**8, n=3, bad_step=1)
    with forbid_host_syncs():
        for g in seq:
            params, state, ss, info = engine.step(params, g, state, ss)
        acc = engine.accumulate(engine.accumulate(None, seq[0]), seq[2])
        params, state, ss, info = engine.step(params, acc, state, ss)
    assert ss.scale.item() == 2.0**7  # the step with the inf backed off, without a sync
    assert not info["found_inf"] and state.tx_state[1][0].count.item() == 3


@pytest.mark.slow
def test_params_from_a_compiled_pure_step_are_still_one_flat_buffer():
    """Inductor returns the new leaves as aliases of one buffer without autograd's view link
    (``_base`` is None): flat_params and grad_and_value must take them all the same."""
    p0 = odd_params()
    engine = fzero.zero1(tx(), param_dtype=torch.float16, loss_scale=None)
    params, state, ss = engine.init(p0)
    grads = optree.tree_map(lambda x: x.half(), grads_like(p0, 0))
    params, state, ss, _ = torch.compile(engine.step, fullgraph=True)(params, grads, state, ss)
    flat = engine.flat_params(params)
    assert flat.shape == (engine.layout.padded_numel,) and torch.equal(flat, fzero.flatten(params, engine.layout))
    flat[:1] = 7.0  # it is the params' memory, not a copy
    assert float(optree.tree_leaves(params)[0].reshape(-1)[0]) == 7.0
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(fzero.unflatten(flat, engine.layout)),
                                                   optree.tree_leaves(params)))
    loss = lambda p: sum((x.float() ** 2).sum() for x in optree.tree_leaves(p))
    shard, value = engine.grad_and_value(loss)(params, ss)
    torch.testing.assert_close(shard.grads, fzero.flatten(torch.func.grad(loss)(params), engine.layout))


@pytest.mark.slow
def test_whole_train_step_compiles_into_one_graph():
    """Forward, backward and engine.step in one graph (differentiating the flat buffer), equal to
    the same train step run eagerly."""
    from fzero.models import gpt

    cfg = gpt.GPTConfig(31, block_size=8, n_layer=1, n_head=2, n_embd=16)
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, 31, (2, 8), generator=g) for _ in range(2))
    out = []
    for compile in (False, True):
        engine = fzero.zero1(tx(), param_dtype=torch.float32, loss_scale=None, donate=True)
        params, state, ss = engine.init(gpt.init(torch.Generator().manual_seed(0), cfg))
        flat, like = engine.flat_params(params), params  # like: the tree's structure, for dynamo

        def train_step(flat, state, ss):
            loss_of = lambda f: gpt.loss(fzero.unflatten(f, engine.layout, like=like), batch, cfg)
            grads, loss = torch.func.grad_and_value(loss_of)(flat)
            return (*engine.step(flat, grads, state, ss)[:3], loss)

        step = torch.compile(train_step, fullgraph=True) if compile else train_step
        losses = []
        for _ in range(3):
            flat, state, ss, loss = step(flat, state, ss)
            losses.append(loss)
        out.append((flat, torch.stack(losses)))
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-5, atol=0)
    # Adam divides by sqrt(v) + eps: where a grad is ~1e-9, its last-bit rounding moves the
    # update by a fraction of lr (1e-2), hence the absolute tolerance.
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_compiled_step_takes_reduced_shards_after_another_layout():
    """Compiled steps from ``grad_and_value``'s reduced shards, for several layouts in one
    process (dynamo retraces ``Engine.step``, and may trace the sizes as symbols), equal eager."""
    torch._dynamo.reset()
    for n in (300, 500, 700):
        engine = fzero.zero1(tx(), param_dtype=torch.float16, loss_scale=None)
        params, state, ss = engine.init({"a": torch.randn(n), "b": torch.randn(3, 5)})
        loss = lambda p: sum((x.float() ** 2).sum() for x in optree.tree_leaves(p))
        grads, _ = engine.grad_and_value(loss)(params, ss)
        compiled = torch.compile(engine.step, fullgraph=True)(params, grads, state, ss)
        eager = engine.step(params, grads, state, ss)
        torch.testing.assert_close(compiled[1].master, eager[1].master, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_warm_process_traces_the_donated_step_once(tmp_path, monkeypatch):
    """The step compiled twice over one inductor cache, dynamo reset between (a second process):
    the second compile finds the first trace's graph in the cache and traces once. torch
    restarts the trace of a graph with 0-d float64 CPU inputs (the hyperparameters) on a cache
    miss; had the first trace's graph differed from the restarted one (the donated step copying
    the hyperparameters into themselves), its entry would never be written and every process
    would trace the step twice (docs/startup.md)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    p0 = odd_params()
    restarts = []
    for _ in range(2):
        torch._dynamo.reset()
        torch._dynamo.utils.clear_compilation_metrics()
        engine = fzero.zero1(tx(), param_dtype=torch.float16, donate=True)
        params, state, ss = engine.init(p0)
        torch.compile(engine.step, fullgraph=True)(params, optree.tree_map(torch.Tensor.half, grads_like(p0, 0)), state, ss)
        restarts.append([sorted(m.restart_reasons or ()) for m in torch._dynamo.utils.get_compilation_metrics()])
    assert restarts[1] == [[]], restarts
