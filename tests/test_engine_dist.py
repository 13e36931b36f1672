"""Multi-rank engine tests on spawned gloo ranks (CPU): sharding, agreement, skips, memory."""
import optree
import pytest
import torch

import fzero
from fzero import transforms
from distributed import init_group, run_ranks
from helpers import NewTensors, grads_like, mean_grads, odd_params

STEPS = 6
BAD_STEP = 3  # rank 1 alone sees an inf at this step


def rank_grads(p0, step, rank):
    return grads_like(p0, 100 * step + rank)


def train(rank, world_size, param_dtype, reduce_dtype, wire_dtype=None):
    # Each rank builds its own weights (a seed per rank): every rank trains rank 0's, as under DDP.
    p0 = odd_params(seed=rank)
    engine = fzero.zero1(
        transforms.adamw(lr=1e-2, weight_decay=0.1),
        param_dtype=param_dtype,
        loss_scale=fzero.StaticLossScale(4.0),
        reduce_dtype=reduce_dtype,
        wire_dtype=wire_dtype,
    )
    params, state, ss = engine.init(p0)
    infos = []
    for step in range(STEPS):
        grads = optree.tree_map(lambda g: (g * 4.0).to(param_dtype), rank_grads(odd_params(), step, rank))
        if step == BAD_STEP and rank == 1:
            grads["w"][2, 3] = float("inf")
        params, state, ss, info = engine.step(params, grads, state, ss)
        infos.append(bool(info["found_inf"]))
    layout = engine.layout
    return {
        "flat_params": fzero.flatten(params, layout),
        "master": state.master,
        "state_bytes": engine.state_bytes(state),
        "shard_numel": layout.shard_numel,
        "numel": layout.numel,
        "found_inf": infos,
        "count": int(state.tx_state[0].count),
    }


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "param_dtype,reduce_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
     (torch.float16, torch.float16)],
)
def test_ranks_agree_and_equal_one_process_fed_mean_grads(world_size, param_dtype, reduce_dtype):
    out = run_ranks(train, world_size, param_dtype, reduce_dtype)
    p0 = odd_params()
    for r in out:  # every rank skipped exactly the step where one rank saw an inf
        assert r["found_inf"] == [s == BAD_STEP for s in range(STEPS)]
        assert r["count"] == STEPS - 1
        assert torch.equal(r["flat_params"], out[0]["flat_params"])  # bitwise identical params
    # reference: one process, mean of the ranks' (exactly representable) grads, bad step dropped
    ref = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1), param_dtype=torch.float32, loss_scale=None)
    params, state, ss = ref.init(p0)
    for step in range(STEPS):
        if step == BAD_STEP:
            continue
        per_rank = [optree.tree_map(lambda g: g.to(param_dtype).float(), rank_grads(p0, step, r)) for r in range(world_size)]
        mean = optree.tree_map(lambda *gs: torch.stack(gs).double().mean(0).float(), *per_rank)
        params, state, ss, _ = ref.step(params, mean, state, ss)
    master = torch.cat([r["master"] for r in out])[: out[0]["numel"]]
    tol = dict(rtol=1e-5, atol=1e-6) if reduce_dtype == torch.float32 else dict(rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(master, state.master[: out[0]["numel"]], **tol)
    # per-rank optimizer state: master + mu + nu on S elements (+ a few 0-d scalars), not on P
    S, P = out[0]["shard_numel"], out[0]["numel"]
    assert S * world_size - P < world_size * 64
    for r in out:
        assert 12 * S <= r["state_bytes"] <= 12 * S + 64


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_grads_sent_in_their_own_dtype_train_as_an_fp32_copy_of_them_does(world_size, param_dtype):
    """The default wire (16-bit grads in an all-to-all, summed in FP32 where they land) against
    ``wire_dtype=torch.float32`` (an FP32 copy, reduce-scattered): the same skips, and at 2 ranks
    the same bits (one FP32 addition either way); beyond, the same sums in another order."""
    own, copy = (run_ranks(train, world_size, param_dtype, torch.float32, wire) for wire in (None, torch.float32))
    for a, b in zip(own, copy):
        assert a["found_inf"] == b["found_inf"] == [s == BAD_STEP for s in range(STEPS)]
        if world_size == 2:
            assert torch.equal(a["master"], b["master"]) and torch.equal(a["flat_params"], b["flat_params"])
        else:
            torch.testing.assert_close(a["master"], b["master"], rtol=1e-6, atol=1e-7)


def mismatched_layout(rank, world_size):
    p0 = odd_params()
    if rank == 1:
        p0["w"] = torch.zeros(5, 7)
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float16)
    try:
        engine.init(p0)
    except ValueError as e:
        return str(e)
    return "no error"


# Each case: (what rank 0 builds, what rank 1 builds, what the error must say).
CONFIG_CASES = {
    "param_dtype": (dict(param_dtype=torch.float16), dict(param_dtype=torch.bfloat16),
                    "param_dtype is torch.float16 on rank 0 but torch.bfloat16 on rank 1"),
    "reduce_dtype": (dict(reduce_dtype=torch.float32), dict(reduce_dtype=torch.float16),
                     "reduce_dtype is torch.float32 on rank 0 but torch.float16 on rank 1"),
    "wire_dtype": (dict(wire_dtype=None), dict(wire_dtype=torch.float32),
                   "wire_dtype is torch.float16 on rank 0 but torch.float32 on rank 1"),
    "loss_scale": (dict(loss_scale=fzero.DynamicLossScale()), dict(loss_scale=fzero.DynamicLossScale(init_scale=2.0**10)),
                   "loss_scale is DynamicLossScale(init_scale=65536.0"),
    "stage": (dict(stage=1), dict(stage=2), "stage is 1 on rank 0 but 2 on rank 1"),
    "offload": (dict(offload=None), dict(offload="cpu"), "offload is None on rank 0 but 'cpu' on rank 1"),
    "lr": (dict(tx=transforms.adamw(lr=1e-3)), dict(tx=transforms.adamw(lr=2e-3)),
           "transform leaf 2/lr is 0.001 torch.float64 on rank 0 but 0.002 torch.float64 on rank 1"),
    "betas": (dict(tx=transforms.adamw(betas=(0.9, 0.999))), dict(tx=transforms.adamw(betas=(0.9, 0.95))),
              "transform leaf 0/b2 is 0.999 torch.float64 on rank 0 but 0.95 torch.float64 on rank 1"),
    "transform": (dict(tx=transforms.adamw()), dict(tx=transforms.sgd(lr=0.1, momentum=0.9)),
                  "transform state is PyTreeSpec((ScaleByAdamState("),
}


def mismatched_configs(rank, world_size):
    msgs = {}
    for name, cases in CONFIG_CASES.items():
        kw = {"tx": transforms.adamw(), "param_dtype": torch.float16, **cases[rank]}
        engine = fzero.zero1(kw.pop("tx"), **kw)
        try:
            engine.init(odd_params())
            msgs[name] = "no error"
        except ValueError as e:
            msgs[name] = str(e)
    return msgs


@pytest.mark.multirank
def test_ranks_that_disagree_on_the_configuration_fail_at_init_naming_setting_and_ranks():
    out = run_ranks(mismatched_configs, 2)
    for name, (_, _, want) in CONFIG_CASES.items():
        for rank, msgs in enumerate(out):
            assert msgs[name].startswith("engine configuration differs across ranks"), (name, rank, msgs[name])
            assert want in msgs[name], (name, rank, msgs[name])


def world_changed(rank, world_size):
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float16)  # before the group exists
    params, state, ss = engine.init(odd_params())
    init_group(rank, world_size)
    try:
        engine.step(params, grads_like(odd_params(), 0), state, ss)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.multirank
def test_layout_mismatch_across_ranks_names_leaf_and_rank():
    msgs = run_ranks(mismatched_layout, 2)
    want = "leaf 3 is 'w' with shape (7, 5) on rank 0 but 'w' with shape (5, 7) on rank 1"
    assert all(want in m for m in msgs), msgs


@pytest.mark.multirank
def test_world_size_changed_since_init_raises():
    msgs = run_ranks(world_changed, 2, init=False)
    assert all("2 ranks" in m and "initialized for 1" in m for m in msgs), msgs


def clipped_tx():
    return transforms.chain(
        transforms.clip_by_global_norm(0.5),
        transforms.adamw(
            lr=transforms.warmup_cosine_decay(0.0, 1e-2, 2, 6),
            weight_decay=0.2,
            weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p),
        ),
    )


def train_clipped(rank, world_size):
    p0 = odd_params()
    engine = fzero.zero1(clipped_tx(), param_dtype=torch.float32, loss_scale=None)
    params, state, ss = engine.init(p0)
    norms = []
    for step in range(STEPS):
        params, state, ss, info = engine.step(params, rank_grads(p0, step, rank), state, ss)
        norms.append(info["grad_norm"])
    return {"master": state.master, "numel": engine.layout.numel, "norms": torch.stack(norms)}


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_clipping_masks_schedules_across_ranks_equal_one_process(world_size):
    out = run_ranks(train_clipped, world_size)
    p0 = odd_params()
    engine = fzero.zero1(clipped_tx(), param_dtype=torch.float32, loss_scale=None)
    params, state, ss = engine.init(p0)
    norms = []
    for step in range(STEPS):
        mean = mean_grads(lambda r: rank_grads(p0, step, r), world_size)
        params, state, ss, info = engine.step(params, mean, state, ss)
        norms.append(info["grad_norm"])
    assert torch.all(torch.stack(norms) > 0.5)  # every step was clipped
    for r in out:
        torch.testing.assert_close(r["norms"], torch.stack(norms), rtol=1e-6, atol=0)
    master = torch.cat([r["master"] for r in out])[: out[0]["numel"]]
    torch.testing.assert_close(master, state.master[: out[0]["numel"]], rtol=1e-6, atol=1e-7)


@pytest.mark.multirank
def test_two_runs_with_the_same_seed_are_bitwise_identical():
    a = run_ranks(train, 2, torch.float16, torch.float16)
    b = run_ranks(train, 2, torch.float16, torch.float16)
    for ra, rb in zip(a, b):
        assert torch.equal(ra["flat_params"], rb["flat_params"]) and torch.equal(ra["master"], rb["master"])


def donated_flat_steps(rank, world_size, param_dtype, reduce_dtype):
    """Three eager steps on the flat buffer with flat grads, pure and donated: the results,
    whether the params' buffer was kept, and how many [N*S] tensors the steps made. (The
    compiled forms of the donated collectives: tests/test_collectives.py; the compiled main job
    on 2 ranks: tests/test_train.py.)"""
    p0 = odd_params()
    out = {}
    for name, donate in (("pure", False), ("donate", True)):
        engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1), param_dtype=param_dtype,
                             reduce_dtype=reduce_dtype, loss_scale=None, donate=donate)
        params, state, ss = engine.init(p0)
        flat = engine.flat_params(params)
        buffer, made = flat.data_ptr(), 0
        for i in range(3):
            grads = fzero.flatten(rank_grads(p0, i, rank), engine.layout, dtype=param_dtype)
            sent = grads.clone()
            with NewTensors() as new:
                flat, state, ss, _ = engine.step(flat, grads, state, ss)
            made += new.numels.count(engine.layout.padded_numel)
        out[name] = {"flat": flat.clone(), "master": state.master.clone(), "kept": flat.data_ptr() == buffer,
                     "made": made, "grads_kept": torch.equal(grads, sent)}
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("param_dtype,reduce_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16"])
def test_donated_flat_grads_are_reduced_and_params_gathered_in_their_own_buffers(param_dtype, reduce_dtype):
    """With ``donate`` on 2 gloo ranks the step reduces flat grads in their own buffer (BF16:
    pre-divided there too) and gathers the new params into the params' own buffer: no [N*S]
    tensor is made, and the results are those of the pure step, bit for bit."""
    out = run_ranks(donated_flat_steps, 2, param_dtype, reduce_dtype)
    for r in out:
        # pure: the all-reduce's copy of the grads and the gathered params, every step
        assert r["pure"]["made"] >= 2 * 3 and r["pure"]["grads_kept"] and not r["pure"]["kept"]
        assert r["donate"]["made"] == 0 and not r["donate"]["grads_kept"] and r["donate"]["kept"]
        assert torch.equal(r["donate"]["flat"], r["pure"]["flat"]) and torch.equal(r["donate"]["master"], r["pure"]["master"])
    assert torch.equal(out[0]["donate"]["flat"], out[1]["donate"]["flat"])


def timed_collectives(rank, world_size):
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.bfloat16, bucket_bytes=40)  # BF16 summed in FP32
    engine.init(odd_params())
    return engine.time_collectives(), len(engine.layout.buckets)


@pytest.mark.multirank
def test_time_collectives_times_each_bucket_as_the_step_reduces_it_the_same_on_every_rank():
    (first, buckets), (second, _) = run_ranks(timed_collectives, 2)
    assert buckets > 1 and first == second  # the max over ranks
    assert [len(first["reduce_scatter_ms"]), len(first["all_gather_ms"])] == [buckets, buckets]
    assert all(ms > 0 for ms in first["reduce_scatter_ms"] + first["all_gather_ms"])
