"""Hybrid sharding on a 2-D device mesh ``("replicate", "shard")``: 4 spawned gloo ranks on CPU
as 2x2, 1x4 and 4x1 meshes, against one process fed the mean grads; the collectives per group;
checkpoints saved on one mesh and loaded on others."""
import os

import optree
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fzero
import fzero.checkpoint
from fzero import transforms
from comm_model import collective_bytes
from distributed import run_ranks
from helpers import RecordingHybridComm, grads_like, odd_params

STEPS, BAD_STEP, BAD_RANK = 5, 2, 3  # BAD_RANK alone sees an inf at BAD_STEP
SCALE = 4.0


def mesh_of(replicas: int, shards: int):
    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def clipped_tx():
    """Clipping, a weight-decay mask and an lr schedule: every feature that reads the global norm
    or per-leaf settings."""
    return transforms.chain(
        transforms.clip_by_global_norm(0.5),
        transforms.adamw(lr=transforms.warmup_cosine_decay(0.0, 1e-2, 2, STEPS), weight_decay=0.2,
                         weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p)),
    )


def rank_grads(step, rank):
    return grads_like(odd_params(), 100 * step + rank)


def train_on_mesh(rank, world_size, replicas, shards, options):
    # Every rank but rank 0 (replica 0, shard 0) starts from other params: init takes rank 0's.
    p0 = odd_params(seed=rank)
    options = {"param_dtype": torch.float32, **options}
    engine = fzero.zero1(clipped_tx(), loss_scale=fzero.StaticLossScale(SCALE), bucket_bytes=64,
                         mesh=mesh_of(replicas, shards), **options)
    params, state, ss = engine.init(p0)
    found, norms = [], []
    for step in range(STEPS):
        grads = optree.tree_map(lambda g: (g * SCALE).to(options["param_dtype"]), rank_grads(step, rank))
        if step == BAD_STEP and rank == BAD_RANK:
            grads["w"][1, 2] = float("inf")
        if options.get("stage") == 2:  # two micro-batches of loss / 2 (DDP's habit): their sum is the grads
            half = optree.tree_map(lambda g: g / 2, grads)
            grads = engine.accumulate(engine.accumulate(None, half), half)
        params, state, ss, info = engine.step(params, grads, state, ss)
        found.append(bool(info["found_inf"]))
        norms.append(info["grad_norm"])
    return {"flat": fzero.flatten(params, engine.layout), "params": [x.clone() for x in optree.tree_leaves(params)],
            "master": state.master, "numel": engine.layout.numel,
            "shard_numel": engine.layout.shard_numel, "found": found, "norms": torch.stack(norms),
            "state_bytes": engine.state_bytes(state), "count": int(state.tx_state[1][0].count)}


def one_process_reference(world_size):
    """One process, fed the mean of the ranks' grads; the step with the inf dropped."""
    engine = fzero.zero1(clipped_tx(), param_dtype=torch.float32, loss_scale=None)
    params, state, ss = engine.init(odd_params())
    norms = []
    for step in range(STEPS):
        if step == BAD_STEP:
            continue
        mean = optree.tree_map(lambda *gs: torch.stack(gs).double().mean(0).float(),
                               *[rank_grads(step, r) for r in range(world_size)])
        params, state, ss, info = engine.step(params, mean, state, ss)
        norms.append(info["grad_norm"])
    return optree.tree_leaves(params), torch.stack(norms)


@pytest.mark.multirank
@pytest.mark.parametrize("replicas,shards,options", [
    (2, 2, {}), (1, 4, {}), (4, 1, {}), (2, 2, {"stage": 2, "offload": "cpu"}),
], ids=["2x2", "1x4", "4x1", "2x2-stage2-offload"])
def test_mesh_equals_one_process_fed_mean_grads(replicas, shards, options):
    out = run_ranks(train_on_mesh, replicas * shards, replicas, shards, options)
    ref_params, ref_norms = one_process_reference(replicas * shards)
    good = [s for s in range(STEPS) if s != BAD_STEP]
    for r in out:
        assert r["found"] == [s == BAD_STEP for s in range(STEPS)]  # every rank skipped the one step
        assert r["count"] == STEPS - 1
        assert torch.equal(r["flat"], out[0]["flat"])  # params bitwise identical on every rank
        torch.testing.assert_close(r["norms"][good], ref_norms, rtol=1e-6, atol=0)
    for replica in range(replicas):  # each replica holds all shards, bitwise equal to the first's
        mine = out[replica * shards : (replica + 1) * shards]
        assert all(torch.equal(a["master"], b["master"]) for a, b in zip(mine, out[:shards]))
    for got, want in zip(out[0]["params"], ref_params):  # FP32 params: the master itself
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    numel, S = out[0]["numel"], out[0]["shard_numel"]  # the state is sharded over the shard group only: 12P/S
    assert S * shards - numel < shards * 64 * 4  # 4 buckets of 16 elements, each padded per rank
    for r in out:
        assert 13 * S <= r["state_bytes"] <= 13 * S + 128  # master, mu, nu, the bool mask; 0-d scalars


@pytest.mark.multirank
@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_a_mesh_sends_16_bit_grads_and_trains_as_an_fp32_copy_of_them_does(param_dtype):
    """2x2: the 16-bit grads cross the shard group in an all-to-all, summed in FP32 where they
    land (two ranks: one addition, as the reduce-scatter of an FP32 copy makes it); the replicate
    hop then all-reduces that FP32 partial sum, as before (1/S of the bytes, and more than 16
    bits of information after the first sum). Every bit equal, and the same skip."""
    own, copy = (run_ranks(train_on_mesh, 4, 2, 2, {"param_dtype": param_dtype, "wire_dtype": wire})
                 for wire in (None, torch.float32))
    for a, b in zip(own, copy):
        assert a["found"] == b["found"] == [s == BAD_STEP for s in range(STEPS)]
        assert torch.equal(a["master"], b["master"]) and torch.equal(a["flat"], b["flat"])


def count_collectives(rank, world_size, replicas, shards):
    comm = RecordingHybridComm.of_mesh(mesh_of(replicas, shards))
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float32, loss_scale=None,
                         bucket_bytes=64, group=comm)
    params, state, ss = engine.init(odd_params())
    comm.events.clear()
    params, state, ss, _ = engine.step(params, rank_grads(0, rank), state, ss)
    step_counts = comm.counts()
    comm.events.clear()
    loss = lambda p, x: sum((leaf * x).square().sum() for leaf in optree.tree_leaves(p))
    grads, _ = engine.grad_and_value(loss)(params, ss, torch.tensor(1.0 + rank))
    order = [(name, group) for name, group, _ in comm.events]
    errors = []
    try:
        fzero.zero1(transforms.adamw(lr=1e-2), mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    except ValueError as e:
        errors.append(str(e))
    return {"counts": {f"{k[0]}/{k[1]}": v for k, v in step_counts.items()}, "order": order,
            "layout": (engine.layout.padded_numel, engine.layout.shard_numel, len(engine.layout.buckets)),
            "errors": errors}


@pytest.mark.multirank
def test_collectives_per_group_and_their_bytes():
    out = run_ranks(count_collectives, 4, 2, 2)
    padded, S, buckets = out[0]["layout"]
    # benchmarks/comm_model.py plans larger meshes from the same bytes
    model = collective_bytes(padded, 2, 2, reduce_bytes=4, param_bytes=4)
    for r in out:
        assert {k: v[1] for k, v in r["counts"].items()} == {f"{a}/{b}": n for (a, b), n in model.items()}
        # per bucket: a reduce-scatter of the [2*S_b] grads in the shard group, one all-reduce of
        # the [S_b] result (1/S of the grads) over the replicas, an all-gather in the shard group;
        # one all-reduce of the norm (a float64) for all
        assert r["counts"] == {
            "reduce_scatter/shard": [buckets, 4 * padded],
            "all_reduce/replicate": [buckets, 4 * S],
            "all_reduce/shard": [1, 8],
            "all_gather/shard": [buckets, 4 * S],
        }
        # grad_and_value: every bucket's reduce-scatter is issued inside backward, before the
        # first replicate all-reduce (issued when backward is done)
        assert r["order"] == [("reduce_scatter", "shard")] * buckets + [("all_reduce", "replicate")] * buckets
        assert len(r["errors"]) == 1 and "('replicate', 'shard')" in r["errors"][0] and "('dp', 'tp')" in r["errors"][0]
    assert buckets > 1


def compiled_and_eager(rank, world_size):
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float16, bucket_bytes=64, mesh=mesh_of(2, 2))
    compiled = torch.compile(engine.step, fullgraph=True)
    out = {}
    for name, step in (("compiled", compiled), ("eager", engine.step)):
        params, state, ss = engine.init(odd_params())
        for s in range(3):
            grads = optree.tree_map(lambda g: (g * 1024).half(), rank_grads(s, rank))
            params, state, ss, _ = step(params, grads, state, ss)
        out[name] = state.master
    return out


@pytest.mark.multirank
def test_compiled_step_on_a_mesh_equals_eager():
    """FP16 params, dynamic loss scale, 4 buckets, 2x2: the compiled step (one graph, the
    replicate all-reduce inside it) follows the eager one (torch's fused AdamW kernel) within
    rounding."""
    for r in run_ranks(compiled_and_eager, 4):
        torch.testing.assert_close(r["compiled"], r["eager"], rtol=1e-6, atol=1e-6)


def test_group_and_mesh_are_exclusive():
    with pytest.raises(ValueError, match="at most one of group=, mesh= and simulate= .got group and mesh"):
        fzero.zero1(transforms.adamw(lr=1e-2), group=object(), mesh=object())


# ---------------------------------------------------------------- checkpoints across meshes
BATCH = 12  # items per step, split evenly over 1, 2, 3 or 4 data-parallel ranks
SAVED_AT, MORE = 3, 3


def batch(step, rank, ranks):
    return (torch.linspace(-1.0, 1.0, BATCH) * (step + 1) / 3.0)[rank::ranks]


def loss_fn(params, xs):
    return sum(((leaf.reshape(-1, 1) - xs) ** 2).mean() for leaf in optree.tree_leaves(params))


def make_engine(mesh=None):
    return fzero.zero1(clipped_tx(), param_dtype=torch.float32, loss_scale=None, mesh=mesh)


def train_steps(engine, carry, steps, rank, ranks):
    params, state, ss = carry
    losses = []
    for step in steps:
        grads, loss = engine.grad_and_value(loss_fn)(params, ss, batch(step, rank, ranks))
        params, state, ss, _ = engine.step(params, grads, state, ss)
        losses.append(loss)
    return (params, state, ss), torch.stack(losses)


def save_on_mesh(rank, world_size, path):
    engine = make_engine(mesh_of(2, 2))
    carry, _ = train_steps(engine, engine.init(odd_params()), range(SAVED_AT), rank, world_size)
    fzero.checkpoint.save(path, *carry, engine)
    # the same state in the background, while the steps' collectives run on both groups
    future = fzero.checkpoint.async_save(path + "-async", *carry, engine)
    _, losses = train_steps(engine, carry, range(SAVED_AT, SAVED_AT + MORE), rank, world_size)
    future.result()
    return losses


def load_and_continue(rank, world_size, path, mesh):
    engine = make_engine(None if mesh is None else mesh_of(*mesh))
    engine.init(odd_params(seed=5))  # other params: all of the state comes from the checkpoint
    params, state, ss, _ = fzero.checkpoint.load(path, engine)
    _, losses = train_steps(engine, (params, state, ss), range(SAVED_AT, SAVED_AT + MORE), rank, world_size)
    return losses


@pytest.mark.multirank
def test_checkpoint_saved_on_2x2_loads_on_other_meshes_and_continues_the_same_curve(tmp_path):
    path = os.fspath(tmp_path / "ckpt")
    continued = torch.stack(run_ranks(save_on_mesh, 4, path)).mean(0)  # the global loss: equal batches per rank
    assert fzero.checkpoint.read_manifest(path)["world_size"] == 2  # sharded over the shard group
    curves = {
        "1x4": torch.stack(run_ranks(load_and_continue, 4, path, (1, 4))).mean(0),
        "4x1": torch.stack(run_ranks(load_and_continue, 4, path, (4, 1))).mean(0),
        "3 ranks, flat": torch.stack(run_ranks(load_and_continue, 3, path, None)).mean(0),
        "1 process": load_and_continue(0, 1, path, None),
        "1 process, from async_save": load_and_continue(0, 1, path + "-async", None),
    }
    for name, curve in curves.items():
        torch.testing.assert_close(curve, continued, rtol=1e-6, atol=0, msg=lambda m: f"{name}: {m}")
