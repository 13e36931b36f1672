"""Communicators on gloo ranks: collective counts and wire bytes per step (buckets, stage 2, offload),
a dead or absent rank, the averaging reduce-scatter."""
import optree
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fzero
from fzero import transforms
from distributed import run_ranks
from helpers import RecordingComm, grads_like, odd_params

STEPS = 3


def train(rank, world_size, configs):
    p0 = odd_params()
    out = []
    for cfg in configs:
        cfg = dict(cfg)
        micro, backward = cfg.pop("micro", 1), cfg.pop("backward", False)
        comm = RecordingComm.of(None)
        engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1), param_dtype=torch.float16,
                             loss_scale=fzero.StaticLossScale(8.0), group=comm, **cfg)
        params, state, ss = engine.init(p0)
        comm.events.clear()
        for step in range(STEPS):
            acc = None
            for m in range(micro):
                g = optree.tree_map(lambda x: (x * 8).half(), grads_like(p0, 100 * step + 10 * rank + m))
                if backward:  # the same grads, reduced inside backward: d(sum(leaf * c))/d(leaf) * 8 = (8c).half()
                    cs = grads_like(p0, 100 * step + 10 * rank + m)
                    linear = lambda p, cs: sum((leaf.float() * c).sum()
                                               for leaf, c in zip(optree.tree_leaves(p), optree.tree_leaves(cs)))
                    g, _ = engine.grad_and_value(linear)(params, ss, cs)
                acc = g if micro == 1 else engine.accumulate(acc, g)
            params, state, ss, info = engine.step(params, acc, state, ss)
        out.append({
            "params": torch.cat([x.reshape(-1) for x in optree.tree_leaves(params)]),
            "norm": info["grad_norm"],
            "master": state.master,
            "counts": comm.counts(),
            "buckets": len(engine.layout.buckets),
            "padded": engine.layout.padded_numel,
            "state_device": str(state.master.device),
        })
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_buckets_counts_bytes_stage2_offload(world_size):
    configs = [
        {},                                             # 0: one bucket
        {"bucket_bytes": 40},                           # 1: 20 fp16 elements per bucket
        {"bucket_bytes": 40, "reduce_dtype": torch.float16},
        {"micro": 3},                                   # 3: stage 1 accumulation
        {"micro": 3, "stage": 2},                       # 4: stage 2 accumulation
        {"offload": "cpu"},                             # 5: state in host memory
        {"backward": True},                             # 6: reduced inside backward
        {"backward": True, "wire_dtype": torch.float32},  # 7: and as an FP32 copy
        {"wire_dtype": torch.float32},                  # 8: the step's, as an FP32 copy
    ]
    out = run_ranks(train, world_size, configs)
    for r in out:
        one, bucketed, low, acc1, acc2, off, inside, inside_fp32, fp32 = r
        # every layout and mode computes the same params, bitwise
        assert torch.equal(bucketed["params"], one["params"])
        assert torch.equal(off["params"], one["params"])
        torch.testing.assert_close(bucketed["norm"], one["norm"], rtol=1e-6, atol=0)
        torch.testing.assert_close(acc2["master"], acc1["master"], rtol=1e-6, atol=1e-7)  # stage 2 == stage 1
        torch.testing.assert_close(low["params"], one["params"], rtol=2e-3, atol=1e-3)  # FP16 reduce: FP16-close
        assert bucketed["buckets"] > 1
        # per step: one reduce-scatter and one all-gather per bucket, one 8-byte (float64) all-reduce
        for res in (one, bucketed, low):
            b = res["buckets"]
            assert res["counts"]["reduce_scatter"][0] == STEPS * b
            assert res["counts"]["all_gather"][0] == STEPS * b
            assert res["counts"]["all_reduce"] == [STEPS, STEPS * 8]
        # wire bytes: FP16 reduce + FP16 gather = the buffer twice = one DDP (ring) all-reduce
        assert low["counts"]["reduce_scatter"][1] == STEPS * 2 * low["padded"]
        assert low["counts"]["all_gather"][1] == STEPS * 2 * low["padded"]
        # FP32 reduce of FP16 grads: the FP16 buffer goes in as it is, summed in FP32 on arrival
        assert one["counts"]["reduce_scatter"][1] == STEPS * 2 * one["padded"]
        # stage 2 reduce-scatters each micro-batch; stage 1 once per step
        assert acc1["counts"]["reduce_scatter"][0] == STEPS
        assert acc2["counts"]["reduce_scatter"][0] == STEPS * 3
        assert acc2["counts"]["all_gather"][0] == STEPS
        assert off["state_device"] == "cpu"
        # reduced inside backward: the same sums in the same order as the step's reduce
        assert torch.equal(inside["params"], one["params"])
        for res in (inside_fp32, fp32):  # an FP32 copy: the same sums (at 2 ranks the same bits)
            if world_size == 2:
                assert torch.equal(res["params"], one["params"])
            torch.testing.assert_close(res["master"], one["master"], rtol=1e-6, atol=1e-7)
        # wire bytes: the FP16 grads as they are, or an FP32 copy (twice the bytes)
        assert inside["counts"]["reduce_scatter"] == [STEPS, STEPS * 2 * inside["padded"]]
        for res in (inside_fp32, fp32):
            assert res["counts"]["reduce_scatter"] == [STEPS, STEPS * 4 * res["padded"]]


def dead_peer(rank, world_size):
    import os

    from distributed import init_group

    init_group(rank, world_size, timeout=20)
    engine = fzero.zero1(transforms.adamw(), param_dtype=torch.float16)
    params, state, ss = engine.init(odd_params())
    if rank == 1:
        os._exit(3)  # dies between init and the first step
    grads = optree.tree_map(lambda x: x.half(), grads_like(odd_params(), 0))
    try:
        engine.step(params, grads, state, ss)
    except fzero.CollectiveError as e:
        return str(e)
    return "no error"


@pytest.mark.multirank
def test_a_dead_rank_makes_the_others_fail_naming_the_collective():
    import time

    t0 = time.time()
    out = run_ranks(dead_peer, 2, init=False, may_die=(1,), timeout=120)
    assert out[1] is None
    assert "fzero: reduce_scatter of grads (bucket 0 of 1" in out[0] and "failed on rank 0 of 2" in out[0], out[0]
    assert time.time() - t0 < 90  # bounded by the group's 20 s timeout (plus start-up), no hang


def never_joins(rank, world_size):
    import time

    from distributed import init_group

    if rank == 1:
        return "absent"
    t0 = time.time()
    try:
        init_group(rank, world_size, timeout=5)
    except Exception as e:  # torch raises DistStoreError / RuntimeError depending on version
        return f"{type(e).__name__} after {time.time() - t0:.0f}s: {e}"
    return "joined"


@pytest.mark.multirank
def test_a_rank_that_never_joins_times_out_instead_of_hanging():
    out = run_ranks(never_joins, 2, init=False, timeout=120)
    assert out[1] == "absent"
    assert out[0] != "joined" and "after" in out[0], out[0]


def mean_of_ranks(rank, world_size, mesh=None):
    if mesh is None:
        comm = fzero.comm.Comm.of(None)
    else:  # hybrid: the mean covers the replicas too
        comm = fzero.comm.comm_of_mesh(init_device_mesh("cpu", mesh, mesh_dim_names=("replicate", "shard")))
    layout = fzero.make_layout({"a": torch.zeros(10), "b": torch.zeros(7)}, comm.world_size, alignment=2, bucket_numel=8)
    out = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        buckets = [torch.full((comm.world_size * b.shard,), 64.0 * (rank + 1), dtype=dtype) for b in layout.buckets]
        kept = [x.clone() for x in buckets]
        partial, factor = comm.reduce_scatter_mean(buckets, layout)
        assert all(torch.equal(x, k) for x, k in zip(buckets, kept))  # the inputs are left alone
        assert factor == comm.mean_factor(dtype)
        out[str(dtype)] = (partial.float() * factor, partial.dtype)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,mesh", [(2, None), (4, None), (4, (2, 2)), (4, (4, 1))])
def test_reduce_scatter_mean_hides_the_pre_post_split(world_size, mesh):
    mean = 64.0 * (world_size + 1) / 2  # every partial sum exact in BF16
    for res in run_ranks(mean_of_ranks, world_size, mesh):
        for dtype, (x, got_dtype) in res.items():
            assert str(got_dtype) == dtype  # reduced in the dtype it was given
            torch.testing.assert_close(x, torch.full_like(x, mean), rtol=0, atol=0)


def gather_in_flight(rank, world_size):
    from fzero.layout import make_layout
    comm = fzero.comm.Comm.of(None)
    layout = make_layout(odd_params(), world_size, bucket_numel=20)
    shard = torch.randn(layout.shard_numel, generator=torch.Generator().manual_seed(rank)).half()
    want = comm.all_gather_into(torch.full((layout.padded_numel,), float("nan"), dtype=torch.float16), shard, layout)
    out = torch.full((layout.padded_numel,), float("nan"), dtype=torch.float16)
    pending = comm.start_all_gather_into(out, shard, layout)
    views = fzero.flat.split_buckets(out, layout)
    got = []
    for i in reversed(range(len(layout.buckets))):  # bucket by bucket, the first issued first
        pending.wait(i)
        assert all(w.is_completed() for w in pending.works[i])
        got.append((i, views[i].clone()))
    pending.wait_all()  # again: nothing left to wait for
    return {"want": want, "out": out, "got": got, "buckets": len(layout.buckets),
            "views": [v.clone() for v in fzero.flat.split_buckets(want, layout)]}


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_an_all_gather_left_in_flight_lands_bucket_by_bucket_as_the_blocking_one(world_size):
    for r in run_ranks(gather_in_flight, world_size):
        assert r["buckets"] > 1
        assert torch.equal(r["out"], r["want"])
        for i, view in r["got"]:  # each bucket complete once waited for, before the next wait
            assert torch.equal(view, r["views"][i])
