"""``zero1(overlap_gather=True)`` (``fzero.arriving``): the step hands out params whose all-gather
is still in flight; they are the blocking gather's bit for bit -- read at once after the step,
through a forward and backward, flat or as a pytree, donated or not, at 2 and 4 ranks and on a
2x2 mesh -- and a leaf waits for its own bucket only.

Reference: the same training with ``overlap_gather=False`` in the same process."""
import optree
import pytest
import torch

import fzero
import fzero.checkpoint
from fzero import transforms
from fzero.arriving import Arriving
from fzero.comm.communicator import InFlightGather
from distributed import run_ranks
from helpers import grads_like, odd_params

STEPS = 3


def linear(p, cs):
    """A loss whose grads are ``cs``: the forward touches every leaf."""
    return sum((leaf.float() * c).sum() for leaf, c in zip(optree.tree_leaves(p), optree.tree_leaves(cs)))


def train(rank, world_size, cfg):
    """``cfg``: ``flat`` (the flat buffer), ``donate``, ``backward`` (grads from
    ``grad_and_value``), ``mesh`` (``(replicas, shards)``), ``save_to`` (a directory)."""
    flat, donate, backward = cfg["flat"], cfg["donate"], cfg["backward"]
    mesh, save_to = cfg.get("mesh"), cfg.get("save_to")
    out = {}
    for overlap in (False, True):
        kw = {}
        if mesh is not None:
            from torch.distributed.device_mesh import init_device_mesh
            kw["mesh"] = init_device_mesh("cpu", mesh, mesh_dim_names=("replicate", "shard"))
        engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1), param_dtype=torch.float16,
                             loss_scale=fzero.StaticLossScale(8.0), bucket_bytes=40, donate=donate,
                             overlap_gather=overlap, **kw)
        params, state, ss = engine.init(odd_params())
        if flat:
            params = engine.flat_params(params)
        seen, kinds = [], set()
        for step in range(STEPS):
            cs = grads_like(odd_params(), 100 * step + rank)
            if backward and not flat:
                grads, _ = engine.grad_and_value(linear)(params, ss, cs)
            else:
                grads = optree.tree_map(lambda c: (c * 8).half(), cs)
                grads = fzero.flatten(grads, engine.layout) if flat else grads
            params, state, ss, _ = engine.step(params, grads, state, ss)
            kinds |= {type(x).__name__ for x in optree.tree_leaves(params)}
            # read at once, as a user might before the next forward
            seen.append([x.clone() for x in optree.tree_leaves(params)])
        if save_to is not None:
            fzero.checkpoint.save(f"{save_to}/{int(overlap)}", params, state, ss, engine)
        out[overlap] = {"seen": seen, "kinds": kinds, "master": state.master.clone()}
    return out


CASES = {
    "pytree": dict(flat=False, donate=False, backward=False),
    "pytree-donated": dict(flat=False, donate=True, backward=False),
    "flat-donated": dict(flat=True, donate=True, backward=False),
    "backward": dict(flat=False, donate=True, backward=True),
}


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_params_in_flight_are_the_blocking_gathers_bit_for_bit(world_size, case):
    for r in run_ranks(train, world_size, CASES[case]):
        assert r[False]["kinds"] == {"Tensor"} and r[True]["kinds"] == {"Arriving"}
        assert torch.equal(r[True]["master"], r[False]["master"])
        for got, want in zip(r[True]["seen"], r[False]["seen"]):
            assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.multirank
def test_on_a_mesh_and_through_a_checkpoint(tmp_path):
    out = run_ranks(train, 4, dict(flat=False, donate=True, backward=True, mesh=(2, 2), save_to=str(tmp_path)))
    for r in out:
        assert r[True]["kinds"] == {"Arriving"}
        for got, want in zip(r[True]["seen"], r[False]["seen"]):
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    # a save right after the step reads the params whole: the same snapshot as the blocking run's
    a, b = (fzero.checkpoint.read_manifest(str(tmp_path / d)) for d in ("0", "1"))
    assert [f["sha256"] for f in a["files"]] == [f["sha256"] for f in b["files"]]


class Work:
    def __init__(self, log, i):
        self.log, self.i = log, i

    def wait(self):
        self.log.append(self.i)


def test_a_leaf_waits_for_its_own_bucket_only_and_views_wait_for_nothing():
    """One process, a gather whose per-bucket Works log their waits."""
    from fzero.arriving import arriving
    layout = fzero.make_layout(odd_params(), 1, bucket_numel=20)
    bucket_of = {layout.paths[k]: i for i, b in enumerate(layout.buckets) for k in b.leaves}
    assert bucket_of["w"] != bucket_of["one"]
    log = []
    gather = InFlightGather(tuple((Work(log, i),) for i in range(len(layout.buckets))), lambda i: f"bucket {i}",
                            lambda what, e: e)
    buffer = torch.arange(layout.padded_numel, dtype=torch.float32)
    params = arriving(buffer, gather, layout, flat=False, like=odd_params())
    w = params["w"]
    # what fzero.backward does to each leaf before the forward, views and metadata: no wait
    leaf = w.detach().requires_grad_()
    view = leaf.t().reshape(-1)[:3]
    assert isinstance(view, Arriving) and leaf.is_leaf and w.shape == (7, 5) and w._base is buffer and log == []
    (view * 2).sum().backward()  # the first call that reads it waits for its bucket
    assert log == [bucket_of["w"]]
    assert type(leaf.grad) is torch.Tensor and leaf.grad.shape == (7, 5)
    w.sum()  # arrived: no second wait
    assert log == [bucket_of["w"]]
    offset = layout.offsets[layout.paths.index("one")]
    assert torch.equal(params["one"], buffer[offset : offset + 1])  # another bucket: waits for that one
    assert log == [bucket_of["w"], bucket_of["one"]]
    flat = arriving(buffer, gather, layout, flat=True)  # the flat buffer waits for every bucket
    flat.sum()
    assert sorted(log[2:]) == list(range(len(layout.buckets)))


@pytest.mark.parametrize("donate", [False, True])
def test_params_in_flight_keep_lineages_checks(donate):
    """A simulated rank of 2 (one process): the step hands out ``Arriving`` leaves; one written
    in place is refused by the next step, as plain params are (``fzero.lineage``)."""
    from fzero.lineage import ParamsEditedError
    engine = fzero.zero1(transforms.adamw(lr=1e-2), param_dtype=torch.float16, loss_scale=None, bucket_bytes=40,
                         simulate=(0, 2), donate=donate, overlap_gather=True)
    params, state, ss = engine.init(odd_params())
    grads = lambda: optree.tree_map(lambda g: g.half(), grads_like(odd_params(), 0))  # noqa: E731
    params, state, ss, _ = engine.step(params, grads(), state, ss)
    assert {type(x) for x in optree.tree_leaves(params)} == {Arriving}
    params, state, ss, _ = engine.step(params, grads(), state, ss)  # unedited: fine
    with torch.no_grad():
        params["w"].add_(1.0)
    with pytest.raises(ParamsEditedError, match="engine.step: the params were written in place"):
        engine.step(params, grads(), state, ss)


def test_params_in_flight_save_and_copy_as_plain_tensors(tmp_path):
    import copy
    from fzero.arriving import arriving
    layout = fzero.make_layout(odd_params(), 1, bucket_numel=20)
    log = []
    gather = InFlightGather(tuple((Work(log, i),) for i in range(len(layout.buckets))), lambda i: f"bucket {i}",
                            lambda what, e: e)
    params = arriving(torch.arange(layout.padded_numel, dtype=torch.float32), gather, layout, flat=False,
                      like=odd_params())
    torch.save(params, tmp_path / "p.pt")
    loaded = torch.load(tmp_path / "p.pt")
    assert sorted(log) == list(range(len(layout.buckets)))  # each waited for its bucket first
    # deepcopy's memo is keyed by id: copied many times, so that a temporary alias whose id a
    # later one took would show (it did, about one copy in ten, before the alias was kept alive)
    for _ in range(30):
        copied = copy.deepcopy(params)
        storages = {c.untyped_storage().data_ptr() for c in optree.tree_leaves(copied)}
        assert len(storages) == 1  # one copy of the buffer, the leaves views of it, as for plain params
        for a, b, c in zip(optree.tree_leaves(params), optree.tree_leaves(loaded), optree.tree_leaves(copied)):
            assert type(b) is torch.Tensor and type(c) is torch.Tensor
            assert torch.equal(b, a.as_subclass(torch.Tensor)) and torch.equal(c, b)


def test_a_failed_gather_is_named_at_the_wait_of_its_bucket():
    class Failing:
        def wait(self):
            raise RuntimeError("Connection closed by peer")

    gather = InFlightGather(((), (Failing(),)), lambda i: f"all_gather of params (bucket {i} of 2)",
                            lambda what, e: ValueError(f"{what} failed: {e}"))
    gather.wait(0)  # its own bucket arrived
    with pytest.raises(ValueError, match=r"^all_gather of params \(bucket 1 of 2\) failed: Connection closed by peer$"):
        gather.wait(1)
