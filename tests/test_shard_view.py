"""fzero.shard_view: the context a transform gets on a rank's shard -- which leaf each element
belongs to, groups of leaves compacted (transforms.partition), leaves made whole through the
communicator (Muon) -- and Muon + AdamW under the engine at 1, 2 and 4 ranks and on a 2x2 mesh,
bit for bit the one-process run."""
import contextlib
import importlib
import math

import optree
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fzero
from fzero import transforms
from fzero.comm import SimulatedComm
from fzero.flat import tree_shard
from fzero.layout import make_layout
from fzero.shard_view import ShardView, leaf_runs
from fzero.transforms.tree import leaf_paths
from fzero.whole_leaves import assign
from distributed import run_ranks
from helpers import forbid_host_syncs

STEPS = 50


def model(seed=0):
    """A small GPT's shapes: embeddings and head (AdamW), blocks of matrices (Muon) and biases
    (AdamW), a matrix smaller than any shard, and a long 1-D leaf last (AdamW). At 4 ranks
    (alignment 64) shard edges fall inside ``blocks/0/w`` and ``blocks/1/w``, and the last rank
    holds AdamW's elements only."""
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(13, 8, generator=g),
            "blocks": [{"w": torch.randn(8, 24, generator=g), "b": torch.randn(24, generator=g),
                        "v": torch.randn(24, 8, generator=g)} for _ in range(2)],
            "small": torch.randn(3, 5, generator=g),
            "head": torch.randn(8, 13, generator=g),
            "tail": torch.randn(400, generator=g)}


def labels(p):
    """nanoGPT-speedrun style: Muon for the hidden matrices, AdamW for the rest."""
    paths, leaves, spec = optree.tree_flatten_with_path(p)
    return spec.unflatten(["muon" if x.ndim == 2 and path[0] in ("blocks", "small") else "adamw"
                           for path, x in zip(paths, leaves)])


def muon_adamw():
    return transforms.partition({
        "muon": transforms.muon(lr=0.02, weight_decay=0.01),
        "adamw": transforms.adamw(lr=3e-3, weight_decay=0.1,
                                  weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p)),
    }, labels)


def grads_at(step):
    g = torch.Generator().manual_seed(100 + step)
    return optree.tree_map(lambda x: torch.randn(x.shape, generator=g), model())


def global_ids(layout, rank):
    """Rank ``rank``'s shard of the global element numbers 1..P (padding 0), as float64."""
    tree = layout.treespec.unflatten([
        torch.arange(g + 1, g + 1 + math.prod(s), dtype=torch.float64).view(s)
        for g, s in zip(layout.global_offsets, layout.shapes)])
    return tree_shard(tree, layout, rank, dtype=torch.float64)


LAYOUTS = [(1, 64, None), (2, 64, None), (3, 8, None), (4, 64, 40), (4, 8, 100)]  # world size, alignment, bucket numel


@pytest.mark.parametrize("world_size,alignment,bucket_numel", LAYOUTS)
def test_runs_cover_every_element_of_every_leaf_once(world_size, alignment, bucket_numel):
    layout = make_layout(model(), world_size, alignment=alignment, bucket_numel=bucket_numel)
    seen = {i: [] for i in range(len(layout.shapes))}
    for rank in range(world_size):
        runs = leaf_runs(layout, rank)
        ids = global_ids(layout, rank)
        assert all(a.shard_at + a.length <= b.shard_at for a, b in zip(runs, runs[1:]))  # in shard order, disjoint
        for r in runs:
            seen[r.leaf].append((r.start, r.start + r.length))
            # the run holds the leaf's elements start.. : their global numbers say so
            want = torch.arange(r.length, dtype=torch.float64) + layout.global_offsets[r.leaf] + r.start + 1
            assert torch.equal(ids[r.shard_at : r.shard_at + r.length], want)
    for i, pieces in seen.items():
        pieces.sort()
        assert pieces[0][0] == 0 and pieces[-1][1] == math.prod(layout.shapes[i])
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


def root_view(layout, rank):
    return ShardView.root(model(), layout, SimulatedComm(rank, layout.world_size), torch.device("cpu"))


def label_of_ids(layout, tags):
    """The label of each global element number (1..P), as a function."""
    ends = [g + math.prod(s) for g, s in zip(layout.global_offsets, layout.shapes)]
    return lambda gid: tags[next(i for i, e in enumerate(ends) if gid <= e)]


@pytest.mark.parametrize("world_size,alignment,bucket_numel", LAYOUTS)
def test_split_compacts_each_group_in_shard_order_and_join_inverts_it(world_size, alignment, bucket_numel):
    layout = make_layout(model(), world_size, alignment=alignment, bucket_numel=bucket_numel)
    tags = optree.tree_leaves(labels(model()))
    label = label_of_ids(layout, tags)
    for rank in range(world_size):
        view, ids = root_view(layout, rank), global_ids(layout, rank)
        split = view.split(lambda tree: tags)
        parts = split.take(ids)
        for k in ("muon", "adamw"):  # every label a leaf has, on every rank (empty if none here)
            want = [x for x in ids.tolist() if x > 0 and label(int(x)) == k]
            assert parts[k].tolist() == want
            assert split.parts[k].numel == len(want)
        assert torch.equal(split.join(parts), ids)  # padding: zero, as in ids
        again = lambda tree: tags
        assert view.split(again) is view.split(again)  # worked out once per labels_of


def test_a_split_of_a_group_is_a_split_of_its_elements():
    layout = make_layout(model(), 2, alignment=8, bucket_numel=100)
    tags = optree.tree_leaves(labels(model()))
    label = label_of_ids(layout, tags)
    view, ids = root_view(layout, 1), global_ids(layout, 1)
    outer = view.split(lambda tree: tags)
    muon = outer.parts["muon"]
    inner_tags = ["wide" if x.shape[0] < x.shape[1] else "tall" for x in optree.tree_leaves(muon.tree)]
    inner = muon.split(lambda tree: inner_tags)
    mine = outer.take(ids)["muon"]
    parts = inner.take(mine)
    shape_of = {gid: s for g, s in zip(layout.global_offsets, layout.shapes) for gid in range(g + 1, g + 1 + math.prod(s))}
    for k in ("wide", "tall"):
        want = [x for x in ids.tolist() if x > 0 and label(int(x)) == "muon"
                and ("wide" if shape_of[int(x)][0] < shape_of[int(x)][1] else "tall") == k]
        assert parts[k].tolist() == want
    assert torch.equal(inner.join(parts), mine)


def test_whole_from_a_group_of_a_group_is_fn_of_each_of_its_leaves():
    layout = make_layout(model(), 1, alignment=8, bucket_numel=100)  # buckets in reverse leaf order
    tags = optree.tree_leaves(labels(model()))
    view = root_view(layout, 0)
    by_label = lambda tree: tags
    muon = view.split(by_label).parts["muon"]
    tall = muon.split(lambda tree: ["wide" if x.shape[0] < x.shape[1] else "tall" for x in optree.tree_leaves(tree)])
    x = view.split(by_label).take(tree_shard(model(), layout, 0, dtype=torch.float32))["muon"]
    fn = lambda m: m * m.shape[0] - m.sum()  # each element depends on the whole leaf
    got = tall.parts["tall"].whole(tall.take(x)["tall"], fn, dtype=torch.float64)
    want = [fn(leaf).double().reshape(-1) for path, leaf in zip(*leaf_paths(model())[:2])
            if path.startswith("blocks") and path.endswith("v")]  # the [24, 8] matrices, in shard order
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.cat(want[::-1]))  # the buckets hold the leaves in reverse order


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_groups_mask_is_its_part_of_the_shards_mask(world_size):
    layout = make_layout(model(), world_size, alignment=8)
    tags = optree.tree_leaves(labels(model()))
    for rank in range(world_size):
        view = root_view(layout, rank)
        split = view.split(lambda tree: tags)
        sub = split.parts["adamw"]
        is_matrix = lambda p: optree.tree_map(lambda x: x.ndim > 1, p)  # the decay mask, on the group's tree
        got = sub.to_shard(is_matrix(sub.tree))
        want = split.take(view.to_shard(is_matrix(model())))["adamw"]
        assert got.dtype == torch.bool and torch.equal(got, want)
        assert sorted(leaf_paths(sub.tree)[0]) == ["blocks/0/b", "blocks/1/b", "embed", "head", "tail"]


def test_whole_applies_fn_to_each_leaf_whole_at_world_size_1():
    layout = make_layout(model(), 1)
    view = root_view(layout, 0)
    shard = tree_shard(model(), layout, 0, dtype=torch.float32)
    fn = lambda m: m * m.shape[0] - m.sum()  # each element depends on the whole leaf
    got = view.whole(shard, fn)
    assert torch.equal(got, tree_shard(optree.tree_map(fn, model()), layout, 0, dtype=torch.float32))


def test_work_is_divided_by_cost_largest_first():
    big, mid, small = torch.Size([64, 256]), torch.Size([64, 64]), torch.Size([8, 8])
    assert assign([small, big, mid, mid], 2) == [1, 0, 1, 1]  # the big one alone outweighs the rest
    assert assign([mid] * 4, 4) == [0, 1, 2, 3]  # equal matrices: one each
    assert assign([mid] * 3, 1) == [0, 0, 0]
    # the cost of a tall matrix is that of its transpose (Newton-Schulz runs on the wide one)
    assert assign([torch.Size([256, 64]), big, mid], 2) == [0, 1, 0]


def run_plain(tx, params, steps):
    state, p = tx.init(params), params
    for i in range(steps):
        updates, state = tx.update(grads_at(i), state, p)
        p = transforms.apply_updates(p, updates)
    return p


def test_engine_at_world_size_1_is_the_plain_transform_bit_for_bit():
    """FP32 params (their own master): the engine's partition on its flat shard, each group
    compacted, Muon's matrices made whole by the view, gives the pytree run's bits."""
    want = run_plain(muon_adamw(), model(), STEPS)
    engine = fzero.zero1(muon_adamw(), param_dtype=torch.float32, loss_scale=None)
    params, state, ss = engine.init(model())
    for i in range(STEPS):
        params, state, ss, _ = engine.step(params, grads_at(i), state, ss)
    for path, got, w in zip(*leaf_paths(params)[:2], optree.tree_leaves(want)):
        assert torch.equal(got, w), path
    muon_state = state.tx_state.inner_states["muon"][0]
    assert muon_state.momentum_buffer.shape == (4 * 192 + 15,)  # the group's elements only
    assert state.tx_state.inner_states["adamw"][0].mu.shape == (104 + 104 + 2 * 24 + 400,)


def train(engine, params, state, ss, steps, first=0):
    for i in range(first, first + steps):
        params, state, ss, _ = engine.step(params, grads_at(i), state, ss)  # the same grads on every rank
    return params, state, ss


def save_after(path, steps, **engine_kw):
    """Train ``steps`` steps from the start and save; the params then (on every rank)."""
    engine = fzero.zero1(muon_adamw(), param_dtype=torch.float32, loss_scale=None, **engine_kw)
    params, state, ss = train(engine, *engine.init(model()), steps)
    fzero.checkpoint.save(path, params, state, ss, engine, extra={"step": steps})
    return [x.clone() for x in optree.tree_leaves(params)]


def load_and_train(path, first, steps, **engine_kw):
    engine = fzero.zero1(muon_adamw(), param_dtype=torch.float32, loss_scale=None, **engine_kw)
    engine.init(model(seed=1))  # other values: all of them come from the checkpoint
    params, state, ss, _ = fzero.checkpoint.load(path, engine)
    params, state, ss = train(engine, params, state, ss, steps, first)
    return [x.clone() for x in optree.tree_leaves(params)]


def test_a_checkpoint_of_grouped_state_resumes_bit_for_bit_in_another_layout(tmp_path):
    """Muon's momentum and AdamW's moments, each over its group's elements only, saved and
    loaded into another alignment and bucketing: 5 + 5 steps give the 10-step run's bits."""
    engine = fzero.zero1(muon_adamw(), param_dtype=torch.float32, loss_scale=None)
    want = [x.clone() for x in optree.tree_leaves(train(engine, *engine.init(model()), 10)[0])]
    save_after(tmp_path / "ckpt", 5)
    got = load_and_train(tmp_path / "ckpt", 5, 5, alignment=8, bucket_bytes=900)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_export_full_writes_each_groups_moments_zero_outside_the_group(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    engine = fzero.zero1(muon_adamw(), param_dtype=torch.float32, loss_scale=None)
    params, state, ss = train(engine, *engine.init(model()), 2)
    fzero.checkpoint.export_full(tmp_path / "full.safetensors", state, engine, moments=True)
    out = safetensors.load_file(tmp_path / "full.safetensors")
    momentum = {k.split("momentum_buffer/")[1]: v for k, v in out.items() if "momentum_buffer/" in k}
    for path, tag in zip(leaf_paths(model())[0], optree.tree_leaves(labels(model()))):
        assert (momentum[path].abs().sum() > 0) == (tag == "muon"), path


@contextlib.contextmanager
def counted_newton_schulz():
    """The shapes Muon runs Newton-Schulz on while inside, in a list."""
    module, calls = importlib.import_module("fzero.transforms.muon"), []
    original = module.newton_schulz

    def counted(m, **kw):
        calls.append(tuple(m.shape))
        return original(m, **kw)

    module.newton_schulz = counted
    try:
        yield calls
    finally:
        module.newton_schulz = original


def train_on_ranks(rank, world_size, mesh, param_dtype, kw):
    extra = {"mesh": init_device_mesh("cpu", mesh, mesh_dim_names=("replicate", "shard"))} if mesh else {}
    engine = fzero.zero1(muon_adamw(), param_dtype=param_dtype, loss_scale=None, **kw, **extra)
    params, state, ss = engine.init(model())
    with counted_newton_schulz() as calls:
        for i in range(STEPS):
            grads = optree.tree_map(lambda g: g.to(param_dtype), grads_at(i))  # the same on every rank
            params, state, ss, _ = engine.step(params, grads, state, ss)
    layout = engine.layout
    straddling = [p for p, o, s in zip(layout.paths, layout.offsets, layout.shapes)
                  if any(o < b.start + k * b.shard < o + math.prod(s) for b in layout.buckets
                         for k in range(1, world_size))]
    muon = engine.shard_context.only_split().parts["muon"].numel
    return {"params": [x.clone() for x in optree.tree_leaves(params)], "calls": len(calls),
            "straddling": straddling, "S": layout.shard_numel, "muon_numel": muon}


def save_on_ranks(rank, world_size, path):
    return save_after(path, 5)


def load_on_ranks(rank, world_size, path):
    return load_and_train(path, 5, 5)


@pytest.mark.multirank
def test_a_checkpoint_of_grouped_state_saved_at_2_ranks_continues_at_1_and_4_bit_for_bit(tmp_path):
    engine = fzero.zero1(muon_adamw(), param_dtype=torch.float32, loss_scale=None)
    want = [x.clone() for x in optree.tree_leaves(train(engine, *engine.init(model()), 10)[0])]
    path = str(tmp_path / "ckpt")
    run_ranks(save_on_ranks, 2, path)
    for got in [load_and_train(path, 5, 5), *run_ranks(load_on_ranks, 4, path)]:
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,mesh,param_dtype,kw", [
    (2, None, torch.float32, {"bucket_bytes": 2400}),
    (4, None, torch.bfloat16, {}),
    (4, (2, 2), torch.float32, {}),
], ids=["2-ranks-fp32-buckets", "4-ranks-bf16", "2x2-mesh-fp32"])
def test_muon_and_adamw_on_shards_equal_one_process_bit_for_bit(world_size, mesh, param_dtype, kw):
    """Every rank is fed the same grads, so their mean is exact and the sharded run must give
    the one-process run's bits, with each matrix orthogonalized by one rank of the shard group
    (a replica's group repeats its own: the replicas hold the same momentum)."""
    out = run_ranks(train_on_ranks, world_size, mesh, param_dtype, kw)
    ref = train_on_ranks(0, 1, None, param_dtype, {})
    for r in out:
        for got, want in zip(r["params"], ref["params"]):
            assert torch.equal(got, want)
    assert out[0]["straddling"], "no matrix crosses a shard edge: the model does not test it"
    if world_size == 4 and mesh is None:
        assert out[-1]["muon_numel"] == 0  # a rank with no Muon element still takes part in the all-to-alls
    matrices = 5  # blocks/{0,1}/{w,v} and small
    assert ref["calls"] == matrices * STEPS
    shards = mesh[1] if mesh else world_size  # each replica's shard group divides the matrices among its ranks
    for replica in range(world_size // shards):
        group = out[replica * shards : (replica + 1) * shards]
        assert sum(r["calls"] for r in group) == matrices * STEPS  # none repeated within the group
        assert max(r["calls"] for r in group) < matrices * STEPS


@pytest.mark.slow
def test_eager_on_a_large_cpu_shard_compiles_the_update_and_gives_the_same_params(monkeypatch):
    """From ``COMPILE_NUMEL`` elements up an eager CPU step compiles the update of a transform
    that takes the whole shard (``compiled_whole``), whose graph holds the groups' gathers and the
    all-to-alls: with inductor's casts as eager's, Muon's matrices come out bit for bit and AdamW's
    leaves within FP32 rounding of the eager run."""
    import fzero.update
    chosen = []
    compiled_whole = fzero.update.compiled_whole
    monkeypatch.setattr(fzero.update, "COMPILE_NUMEL", 512)
    monkeypatch.setattr(fzero.update, "compiled_whole", lambda *a, **k: chosen.append(1) or compiled_whole(*a, **k))
    steps = 3
    want = run_plain(muon_adamw(), model(), steps)
    engine = fzero.zero1(muon_adamw(), param_dtype=torch.float32, loss_scale=None)
    params, state, ss = engine.init(model())
    with torch._inductor.config.patch(emulate_precision_casts=True):
        for i in range(steps):
            params, state, ss, _ = engine.step(params, grads_at(i), state, ss)
    assert len(chosen) == steps
    tags = optree.tree_leaves(labels(model()))
    for tag, path, got, w in zip(tags, *leaf_paths(params)[:2], optree.tree_leaves(want)):
        if tag == "muon":
            assert torch.equal(got, w), path
        else:
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-7, msg=path)


def test_an_overflow_skips_muon_and_adamw_alike_leaving_every_bit():
    """FP16 params, a dynamic loss scale: a step whose grads hold an inf keeps the params and
    every state leaf of both groups (Newton-Schulz of the non-finite momentum is computed and
    dropped), and halves the scale; the next finite step updates both groups."""
    engine = fzero.zero1(muon_adamw(), param_dtype=torch.float16)
    params, state, ss = engine.init(model())
    params, state, ss, _ = engine.step(params, optree.tree_map(lambda g: g.half(), grads_at(0)), state, ss)
    before = [x.clone() for x in optree.tree_leaves((params, state))]
    bad = optree.tree_map(lambda g: g.half(), grads_at(1))
    bad["blocks"][0]["w"][1, 2] = float("inf")
    params, state, ss2, info = engine.step(params, bad, state, ss)
    assert bool(info["found_inf"]) and ss2.scale.item() == ss.scale.item() / 2
    assert all(torch.equal(a, b) for a, b in zip(before, optree.tree_leaves((params, state))))
    params, state, _, info = engine.step(params, optree.tree_map(lambda g: g.half(), grads_at(1)), state, ss2)
    assert not bool(info["found_inf"])
    moved = [not torch.equal(a, b) for a, b in zip(before, optree.tree_leaves(params))]
    assert all(moved)


def test_the_muon_and_adamw_step_makes_no_host_sync():
    """Splits and whole-matrix plans are static Python worked out at init: the step converts
    no tensor to a Python value (FP16 with a dynamic loss scale, the main job's setting)."""
    engine = fzero.zero1(muon_adamw(), param_dtype=torch.float16)
    params, state, ss = engine.init(model())
    grads = optree.tree_map(lambda g: g.half(), grads_at(0))
    before = [x.clone() for x in optree.tree_leaves(params)]
    with forbid_host_syncs():
        for _ in range(2):
            params, state, ss, info = engine.step(params, grads, state, ss)
    assert not bool(info["found_inf"])
    assert all(not torch.equal(a, b) for a, b in zip(before, optree.tree_leaves(params)))  # both groups stepped
