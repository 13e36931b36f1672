"""Checkpoints: world-size-independent round trips, exact resume, crash safety, errors, export.

The multi-rank runs are few and batched (one spawn per world size): the 2 -> 3 -> 1 -> 4 chain
checks, at each link, that the loaded global state is bitwise the saved one, that resuming
matches training straight through (bitwise at the same world size, 1e-6 at another), and
that errors are raised on every rank. Crash points are simulated in-process by a ``_hook``
passed to ``save`` that raises a ``BaseException`` the save does not catch (the files are then
exactly as a kill leaves them); one spawned run really kills a rank in the middle of its write.
Loads racing saves: ``load``'s ``_hook`` saves between its phases (deterministic), and two
spawned processes save and load the same path over and over. Saves racing saves: a save's
``_hook`` starts a second save while the first holds the lock (deterministic), and two spawned
processes save to the same path over and over.
"""
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import time
import warnings

import optree
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import fzero
import transforms
from distributed import run_ranks
from fzero import checkpoint as ck
from fzero.checkpoint import commit, lock, reshard
from helpers import grads_like, odd_params

K, M = 4, 3  # save after K steps, then M more per link of the chain
BAD = 1  # every rank sees an inf at this step: skipped, and the loss scale backs off
BUCKETS = {"bucket_bytes": 24}  # several buckets


def model_params(seed=0, z_shape=(17, 23)):
    """Odd sizes: P = 55 + 391 = 446, so shards split leaves at every world size."""
    p = odd_params(seed)
    p["z"] = torch.randn(*z_shape, generator=torch.Generator().manual_seed(100 + seed))
    return p


def make_engine(**kw):
    tx = transforms.adamw(
        lr=transforms.linear_warmup(1e-3, 1e-2, 3),
        weight_decay=0.1,
        weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p),  # a bool [S] leaf
    )
    scale = fzero.DynamicLossScale(init_scale=16.0, growth_interval=2)
    return fzero.zero1(tx, param_dtype=torch.float16, loss_scale=scale, **kw)


def run_steps(engine, params, state, ss, steps):
    """Grads that do not depend on the rank or world size, so every world size trains alike."""
    p0 = model_params()
    for step in steps:
        grads = optree.tree_map(lambda g: (g * ss.scale).to(torch.float16), grads_like(p0, step))
        if step == BAD:
            grads["w"][0, 0] = float("inf")
        params, state, ss, _ = engine.step(params, grads, state, ss)
    return params, state, ss


def global_view(engine, state, ss):
    """Every state leaf as the global [P] vector (real elements, tree order) or 0-d value."""
    names, leaves, _ = fzero.flat.leaf_paths(state)
    out = {}
    for name, leaf in zip(names, leaves):
        if leaf.ndim == 0:
            out[name] = leaf.clone()
            continue
        flat = engine.comm.all_gather(leaf.float() if leaf.dtype == torch.bool else leaf, engine.layout)
        full = torch.cat([x.reshape(-1) for x in optree.tree_leaves(fzero.unflatten(flat, engine.layout))])
        out[name] = full.bool() if leaf.dtype == torch.bool else full.clone()
    for name, v in zip(type(ss)._fields, ss):
        out["scaler/" + name] = v.clone()
    return out


def assert_views_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def assert_views_close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point() and a[k].ndim:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")
        else:
            assert torch.equal(a[k], b[k]), k


def load_error(path, engine):
    try:
        ck.load(path, engine)
    except ck.CheckpointError as e:
        return str(e)
    return "no error"


def snapshot_dir(path):
    """The snapshot directory the checkpoint at ``path`` points to."""
    with open(os.path.join(path, commit.POINTER)) as f:
        return os.path.join(path, json.load(f)["snapshot"])


def shard_files(path):
    return sorted(glob.glob(os.path.join(snapshot_dir(path), "shard-*.safetensors")))


def entries(path):
    """``path``'s listing, with each snapshot name shown as ``snapshot-*``."""
    return sorted(re.sub(r"^snapshot-[0-9a-f]{32}$", "snapshot-*", name) for name in os.listdir(path))


ONE = sorted([commit.POINTER, commit.MARKER, lock.LOCK, "snapshot-*"])  # after the first save
COMMITTED = sorted(ONE + ["snapshot-*"])  # after two saves or more


def flip_byte(file, from_end=5):
    with open(file, "r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def reference_views(steps):
    """One process, no group: snapshots after each count in ``steps``."""
    engine = make_engine()
    params, state, ss = engine.init(model_params())
    out, done = {}, 0
    for s in steps:
        params, state, ss = run_steps(engine, params, state, ss, range(done, s))
        done = s
        out[s] = global_view(engine, state, ss)
    return out


# ------------------------------------------------------------------------ the 2 -> 3 -> 1 -> 4 chain
def stage_a(rank, world_size, tmp):
    """World 2: save (twice: a new path, then over the old checkpoint), resume exactly."""
    c = os.path.join(tmp, "c")
    engine = make_engine()
    params, state, ss = engine.init(model_params())
    params, state, ss = run_steps(engine, params, state, ss, range(K - 1))
    ck.save(c, params, state, ss, engine, extra={"step": K - 1})
    params, state, ss = run_steps(engine, params, state, ss, range(K - 1, K))
    ck.save(c, params, state, ss, engine, extra={"step": K, "note": "a"})
    at_save = global_view(engine, state, ss)
    ck.export_full(os.path.join(tmp, "master.safetensors"), state, engine)
    ck.export_full(os.path.join(tmp, "params.safetensors"), params, engine)
    saved_params = fzero.flatten(params, engine.layout)
    straight = global_view(engine, *run_steps(engine, params, state, ss, range(K, K + M))[1:])

    fresh = make_engine()
    fresh.init(model_params(seed=7))  # other values: everything must come from the checkpoint
    p2, s2, ss2, extra = ck.load(c, fresh)
    loaded = global_view(fresh, s2, ss2)
    params_equal = torch.equal(fzero.flatten(p2, fresh.layout), saved_params)
    resumed = global_view(fresh, *run_steps(fresh, p2, s2, ss2, range(K, K + M))[1:])

    if rank == 0:  # a copy with one shard missing
        shutil.copytree(c, c + "_missing")
        os.remove(os.path.join(snapshot_dir(c + "_missing"), "shard-00001-of-00002.safetensors"))
    dist.barrier()
    return {
        "at_save": at_save,
        "straight": straight,
        "loaded": loaded,
        "resumed": resumed,
        "extra": json.dumps(extra),
        "params_equal": params_equal,
        "missing": load_error(c + "_missing", fresh),
        "listing": sorted(os.listdir(tmp)),
        "entries": entries(c),
    }


def stage_b(rank, world_size, tmp):
    """World 3, another alignment and several buckets: errors agreed by all ranks, then load c."""
    c = os.path.join(tmp, "c")
    if rank == 0:  # a copy with a flipped byte in the data of rank 1's shard
        shutil.copytree(c, c + "_bad")
        flip_byte(os.path.join(snapshot_dir(c + "_bad"), "shard-00001-of-00002.safetensors"))
    dist.barrier()
    engine = make_engine(alignment=8, **BUCKETS)
    engine.init(model_params(seed=3))
    errors = {"corrupted": load_error(c + "_bad", engine)}
    other = make_engine()
    other.init(model_params(z_shape=(23, 17)))
    errors["model"] = load_error(c, other)
    sgd = fzero.zero1(transforms.sgd(lr=0.1, momentum=0.9), param_dtype=torch.float16)
    sgd.init(model_params())
    errors["transform"] = load_error(c, sgd)

    params, state, ss, extra = ck.load(c, engine)
    loaded = global_view(engine, state, ss)
    params, state, ss = run_steps(engine, params, state, ss, range(K, K + M))
    after = global_view(engine, state, ss)
    ck.save(os.path.join(tmp, "c3"), params, state, ss, engine, extra={"step": K + M})
    return {"loaded": loaded, "after": after, "errors": errors, "buckets": len(engine.layout.buckets)}


def stage_d(rank, world_size, tmp):
    """World 4 with alignment 256: ranks 2 and 3 own only padding (empty shard files)."""
    engine = make_engine(alignment=256)
    engine.init(model_params(seed=4))
    params, state, ss, extra = ck.load(os.path.join(tmp, "c1"), engine)
    loaded = global_view(engine, state, ss)
    params, state, ss = run_steps(engine, params, state, ss, range(K + 2 * M, K + 3 * M))
    after = global_view(engine, state, ss)
    ck.save(os.path.join(tmp, "c4"), params, state, ss, engine)
    return {"loaded": loaded, "after": after, "extra": json.dumps(extra)}


def test_chain_2_3_1_4_round_trips_and_exact_resume(tmp_path):
    tmp = str(tmp_path)
    ref = reference_views([K, K + M, K + 2 * M, K + 3 * M])

    a = run_ranks(stage_a, 2, tmp)[0]
    assert a["params_equal"]
    assert json.loads(a["extra"]) == {"step": K, "note": "a"}
    assert_views_equal(a["loaded"], a["at_save"])  # bitwise
    assert_views_equal(a["resumed"], a["straight"])  # bitwise: same world size
    assert_views_close(a["at_save"], ref[K])
    assert_views_close(a["straight"], ref[K + M])
    assert int(a["at_save"]["tx_state/0/count"]) == K - 1  # step BAD was skipped (and the scale backed off)
    assert "shard-00001-of-00002.safetensors" in a["missing"] and "missing" in a["missing"]
    assert ": ranks 0, 1: shard file" in a["missing"]  # agreed: every rank raised the same error
    # nothing next to the checkpoint; in it the marker, the pointer, the current and the previous snapshot
    assert a["listing"] == ["c", "c_missing", "master.safetensors", "params.safetensors"], a["listing"]
    assert a["entries"] == COMMITTED, a["entries"]

    # export_full: the consolidated FP32 master and FP16 params, keyed by leaf path
    master = load_file(os.path.join(tmp, "master.safetensors"))
    params = load_file(os.path.join(tmp, "params.safetensors"))
    paths, shapes = _paths_shapes()
    full = torch.split(a["at_save"]["master"], [s.numel() for s in shapes])
    for path, shape, flat in zip(paths, shapes, full):
        assert master[path].dtype == torch.float32 and torch.equal(master[path], flat.view(shape)), path
        assert params[path].dtype == torch.float16 and torch.equal(params[path], flat.view(shape).half()), path
    assert sorted(master) == sorted(paths) == sorted(params)

    b = run_ranks(stage_b, 3, tmp)
    for r in b:  # every rank raised, with the same message naming the file / the leaf
        assert r["errors"] == b[0]["errors"]
    err = b[0]["errors"]
    assert "shard-00001-of-00002.safetensors" in err["corrupted"] and "corrupted" in err["corrupted"]
    assert re.search(r"^load .*: rank \d: shard file", err["corrupted"])  # the rank that hashed it; all raised
    assert "'z'" in err["model"] and "(17, 23)" in err["model"] and "(23, 17)" in err["model"]
    assert "state leaf" in err["transform"]
    b = b[0]
    assert b["buckets"] > 1
    assert_views_equal(b["loaded"], a["at_save"])  # 2 -> 3: bitwise the same global state
    assert_views_close(b["after"], a["straight"])  # resumed at another world size
    assert_views_close(b["after"], ref[K + M])

    # world 1, in this process (no group)
    engine = make_engine()
    engine.init(model_params(seed=5))
    params, state, ss, extra = ck.load(os.path.join(tmp, "c3"), engine)
    assert extra == {"step": K + M}
    assert_views_equal(global_view(engine, state, ss), b["after"])  # 3 -> 1 bitwise
    params, state, ss = run_steps(engine, params, state, ss, range(K + M, K + 2 * M))
    c_after = global_view(engine, state, ss)
    assert_views_close(c_after, ref[K + 2 * M])
    ck.save(os.path.join(tmp, "c1"), params, state, ss, engine, extra={"step": K + 2 * M})

    d = run_ranks(stage_d, 4, tmp)[0]
    assert_views_equal(d["loaded"], c_after)  # 1 -> 4 bitwise
    assert_views_close(d["after"], ref[K + 3 * M])
    assert json.loads(d["extra"]) == {"step": K + 2 * M}
    manifest = ck.read_manifest(os.path.join(tmp, "c4"))
    assert manifest["world_size"] == 4 and manifest["extra"] == {} and [f["segments"] for f in manifest["files"]] == [[[0, 256]], [[256, 446]], [], []]

    # the 4-rank checkpoint loads in one process too, bitwise
    engine = make_engine()
    engine.init(model_params())
    _, state, ss, _ = ck.load(os.path.join(tmp, "c4"), engine)
    assert_views_equal(global_view(engine, state, ss), d["after"])

    # nothing pickled: JSON (manifests, pointers, markers) and safetensors files only
    for path in glob.glob(os.path.join(tmp, "c*")):
        for file in glob.glob(os.path.join(path, "**"), recursive=True):
            if os.path.isdir(file):
                continue
            with open(file, "rb") as f:
                head = f.read(9)
            assert head[:1] != b"\x80" and head[:2] != b"PK", file  # no pickle, no torch.save zip
            if file.endswith(".json"):
                json.loads(open(file).read())
            else:
                assert file.endswith(".safetensors") and head[8:9] == b"{", file
                load_file(file)


def _paths_shapes():
    layout = fzero.make_layout(model_params(), 1)
    return list(layout.paths), list(layout.shapes)


# ------------------------------------------------------------------------ crashes
class Killed(BaseException):
    """Not an Exception: the save's error handling does not see it, as with a kill."""


def trained(engine, steps, seed=0):
    params, state, ss = engine.init(model_params(seed))
    return run_steps(engine, params, state, ss, range(steps))


def crash_at(point, truncate=False):
    def hook(where, **info):
        if where == point:
            if truncate:
                with open(info["file"], "r+b") as f:
                    f.truncate(os.path.getsize(info["file"]) // 2)
            raise Killed(where)

    return hook


@pytest.mark.parametrize(
    "point", ["snapshot_created", "shard_written", "manifest_written", "pointer_written", "committed"]
)
def test_crash_at_any_point_leaves_a_loadable_checkpoint(tmp_path, point):
    path = str(tmp_path / "ckpt")
    engine = make_engine()
    params, state, ss = trained(engine, 2)
    ck.save(path, params, state, ss, engine, extra={"v": 1})
    old = global_view(engine, state, ss)
    params, state, ss = run_steps(engine, params, state, ss, range(2, 4))
    new = global_view(engine, state, ss)

    with pytest.raises(Killed):
        ck.save(path, params, state, ss, engine, extra={"v": 2}, _hook=crash_at(point, truncate=point == "shard_written"))
    if point == "pointer_written":  # the new pointer was written, not yet moved into place
        assert [n for n in os.listdir(path) if n.startswith(f".{commit.POINTER}.tmp-")]

    fresh = make_engine()
    fresh.init(model_params(seed=9))
    _, s2, ss2, extra = ck.load(path, fresh)
    committed = point == "committed"
    assert extra == {"v": 2 if committed else 1}
    assert_views_equal(global_view(fresh, s2, ss2), new if committed else old)
    assert os.listdir(tmp_path) == ["ckpt"]  # a save never writes next to path

    # the next save deletes what the crashed one left (recorded in the marker) and nothing else
    before = commit.read_pointer(path)[0]
    ck.save(path, params, state, ss, engine, extra={"v": 3})
    assert entries(path) == COMMITTED and os.listdir(tmp_path) == ["ckpt"]
    assert before in os.listdir(path)  # the previous snapshot stays until the next save
    assert ck.load(path, fresh)[3] == {"v": 3}


@pytest.mark.parametrize("point", ["shard_written", "manifest_written"])
def test_crash_in_the_first_save_then_saves_that_complete(tmp_path, point):
    path = str(tmp_path / "ckpt")
    engine = make_engine()
    params, state, ss = trained(engine, 2)
    with pytest.raises(Killed):
        ck.save(path, params, state, ss, engine, _hook=crash_at(point))
    with pytest.raises(ck.CheckpointError, match="no save to it has completed"):
        ck.load(path, fresh_engine())
    (partial,) = [n for n in os.listdir(path) if n.startswith("snapshot-")]
    if point == "shard_written":  # no manifest: never committed, deleted without a word
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ck.save(path, params, state, ss, engine, extra={"v": 1})
        assert entries(path) == ONE
    else:  # complete but never committed: with no pointer the save cannot tell it from a
        # checkpoint whose pointer was lost, so it keeps it, as the previous one, and says so
        with pytest.warns(UserWarning, match=rf"{commit.POINTER} is missing .* kept {partial}"):
            ck.save(path, params, state, ss, engine, extra={"v": 1})
        assert entries(path) == COMMITTED and partial in os.listdir(path)
    assert ck.load(path, fresh_engine())[3] == {"v": 1}
    ck.save(path, params, state, ss, engine, extra={"v": 2})
    assert entries(path) == COMMITTED and partial not in os.listdir(path)


def crash_rank1_mid_write(rank, world_size, tmp):
    path = os.path.join(tmp, "ckpt")
    engine = make_engine()
    params, state, ss = trained(engine, 2)
    ck.save(path, params, state, ss, engine, extra={"v": 1})
    ck.export_full(os.path.join(tmp, "ref.safetensors"), state, engine)
    params, state, ss = run_steps(engine, params, state, ss, range(2, 4))

    def die(where, **info):
        if where == "shard_written" and rank == 1:
            with open(info["file"], "r+b") as f:
                f.truncate(os.path.getsize(info["file"]) // 2)
            os._exit(1)  # no cleanup, no goodbye to the group

    try:
        ck.save(path, params, state, ss, engine, extra={"v": 2}, _hook=die)
    except ck.CheckpointError as e:  # rank 0 learns from the group that rank 1 is gone
        return str(e)
    return "saved"


def test_rank_killed_mid_write_keeps_previous_checkpoint(tmp_path):
    msg, dead = run_ranks(crash_rank1_mid_write, 2, str(tmp_path), timeout=90, may_die=(1,))
    assert dead is None and msg.startswith("save ") and "did one die?" in msg, msg
    path = str(tmp_path / "ckpt")
    # the surviving rank 0 removed the partial snapshot; the previous one is intact
    assert entries(path) == ONE
    assert sorted(os.listdir(snapshot_dir(path))) == ["manifest.json"] + [f"shard-0000{r}-of-00002.safetensors" for r in range(2)]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ref.safetensors"]
    engine = make_engine()
    engine.init(model_params(seed=3))
    params, state, ss, extra = ck.load(path, engine)
    assert extra == {"v": 1}
    ref = load_file(str(tmp_path / "ref.safetensors"))
    paths, _ = _paths_shapes()
    master = fzero.unflatten(state.master, engine.layout)
    for p, leaf in zip(paths, optree.tree_leaves(master)):
        assert torch.equal(leaf, ref[p]), p
    ck.save(path, params, state, ss, engine)
    assert ck.load(path, engine)[3] == {}


# ------------------------------------------------------------------------ errors, one process
@pytest.fixture
def saved(tmp_path):
    """A 1-rank checkpoint and the engine/state it came from."""
    path = str(tmp_path / "ckpt")
    engine = make_engine()
    params, state, ss = trained(engine, 3)
    ck.save(path, params, state, ss, engine, extra={"epoch": 1, "seen": [1, 2]})
    return path, engine, params, state, ss


def fresh_engine(**kw):
    engine = make_engine(**kw)
    engine.init(model_params(seed=1))
    return engine


def test_corrupted_truncated_missing_shard_and_manifest_name_the_file(saved):
    path, engine, *_ = saved
    shard = os.path.relpath(shard_files(path)[0], path)  # snapshot-<id>/shard-00000-of-00001.safetensors
    for name, damage, want in [
        ("flip", lambda d: flip_byte(os.path.join(d, shard)), "is corrupted: sha256"),
        ("cut", lambda d: os.truncate(os.path.join(d, shard), 100), "has 100 bytes"),
        ("gone", lambda d: os.remove(os.path.join(d, shard)), "is missing"),
    ]:
        bad = f"{path}_{name}"
        shutil.copytree(path, bad)
        damage(bad)
        with pytest.raises(ck.CheckpointError, match=want) as e:
            ck.load(bad, fresh_engine())
        assert os.path.join(bad, shard) in str(e.value)
    # a flipped byte in the data is caught by the checksum only: with verify=False it loads
    flipped = f"{path}_flip"
    ck.load(flipped, fresh_engine(), verify=False)

    os.remove(os.path.join(snapshot_dir(f"{path}_cut"), "manifest.json"))
    with pytest.raises(ck.CheckpointError, match="manifest.json is missing"):
        ck.load(f"{path}_cut", fresh_engine())
    with open(os.path.join(snapshot_dir(path + "_gone"), "manifest.json"), "w") as f:
        f.write('{"format": "fzero-checkpoint", "vers')
    with pytest.raises(ck.CheckpointError, match=r"_gone/snapshot-\w+/manifest.json is corrupted: sha256 \w+ but .*current.json says"):
        ck.load(path + "_gone", fresh_engine())
    edit_manifest(path + "_gone", lambda text: text)  # the pointer now vouches for the truncated text
    with pytest.raises(ck.CheckpointError, match=r"cannot read .*_gone/snapshot-\w+/manifest.json"):
        ck.load(path + "_gone", fresh_engine())
    with open(os.path.join(path + "_flip", commit.POINTER), "w") as f:
        f.write('{"format": "fzero-checkpoint", "version": 2, "snapshot": "../elsewhere", "manifest_sha256": "00"}')
    with pytest.raises(ck.CheckpointError, match=r"current.json: pointer field snapshot = '../elsewhere': must match"):
        ck.load(path + "_flip", fresh_engine())
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.load(path + "_nope", fresh_engine())


def test_incompatible_model_or_transform_names_the_leaf(saved):
    path, *_ = saved
    engine = make_engine()
    engine.init(model_params(z_shape=(23, 17)))
    with pytest.raises(ck.CheckpointError, match=r"leaf 'z' has shape \(17, 23\) in the checkpoint but \(23, 17\)"):
        ck.load(path, engine)
    p = model_params()
    del p["one"]
    engine = make_engine()
    engine.init(p)
    with pytest.raises(ck.CheckpointError, match="checkpoint leaf 'one' .* is not in this model"):
        ck.load(path, engine)
    p = model_params()
    p["extra_bias"] = torch.zeros(3)
    engine = make_engine()
    engine.init(p)
    with pytest.raises(ck.CheckpointError, match="model leaf 'extra_bias' .* is not in the checkpoint"):
        ck.load(path, engine)
    engine = fzero.zero1(transforms.adamw(lr=1e-3), param_dtype=torch.float16)  # no mask, no schedule
    engine.init(model_params())
    with pytest.raises(ck.CheckpointError, match="state leaf 'tx_state/1/inner/weight_decay' .* is not in this engine's optimizer state"):
        ck.load(path, engine)
    engine = make_engine()
    engine.tx = transforms.adamw(lr=transforms.linear_warmup(1e-3, 1e-2, 3), weight_decay=0.1,
                                 weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p),
                                 mu_dtype=torch.bfloat16)
    engine.init(model_params())
    with pytest.raises(ck.CheckpointError, match="'tx_state/0/mu' is shard float32 in the checkpoint but shard bfloat16"):
        ck.load(path, engine)


def test_manifest_contents_and_no_pickle(saved):
    path, engine, params, state, ss = saved
    m = ck.read_manifest(path)
    assert m["format"] == "fzero-checkpoint" and m["version"] == ck.VERSION == 2 and m["world_size"] == 1
    assert m["param_dtype"] == "float16" and m["step"] is None  # extra has no "step"
    assert [(e["path"], e["shape"], e["offset"]) for e in m["layout"]["leaves"]] == [
        ("blocks/0/g", [13], 0), ("blocks/1/g", [3, 1, 2], 13), ("one", [1], 19), ("w", [7, 5], 20), ("z", [17, 23], 55)]
    scalars = {e["name"]: e["value"] for e in m["state"] if e["kind"] == "scalar"}
    assert scalars["tx_state/0/b2"] == 0.999 and scalars["tx_state/1/inner/weight_decay"] == 0.1
    assert m["loss_scale"]["scale"] == float(ss.scale) and m["extra"] == {"epoch": 1, "seen": [1, 2]}
    (entry,) = m["files"]
    assert entry["segments"] == [[0, 446]] and len(entry["sha256"]) == 64
    tensors = load_file(os.path.join(snapshot_dir(path), entry["file"]))
    assert sorted(tensors) == ["master", "tx_state/0/mu", "tx_state/0/nu", "tx_state/1/mask"]
    assert tensors["tx_state/1/mask"].dtype == torch.bool and tensors["master"].shape == (446,)  # no padding


def test_manifest_step_is_extras_step(saved, tmp_path):
    path, engine, params, state, ss = saved
    ck.save(path, params, state, ss, engine, extra={"step": 7, "seed": 1})
    assert ck.read_manifest(path)["step"] == 7  # not the optimizer's count (2: one step was skipped)
    assert int(state.tx_state[0].count) == 2
    for bad in (-1, 2.0, True, "7", None):
        with pytest.raises(ck.CheckpointError, match=r"extra\['step'\] = .*: must be an integer >= 0"):
            ck.save(path, params, state, ss, engine, extra={"step": bad})
    assert ck.read_manifest(path)["step"] == 7  # the refused saves committed nothing


def test_save_load_same_engine_bitwise_params_and_extra_validation(saved, tmp_path):
    path, engine, params, state, ss = saved
    p2, s2, ss2, extra = ck.load(path, fresh_engine())
    assert extra == {"epoch": 1, "seen": [1, 2]}
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves((params, state, ss)), optree.tree_leaves((p2, s2, ss2))))
    assert optree.tree_structure(p2) == optree.tree_structure(params)
    with pytest.raises(ck.CheckpointError, match="not JSON serializable"):
        ck.save(str(tmp_path / "x"), params, state, ss, engine, extra={"t": torch.zeros(1)})
    assert not os.path.exists(tmp_path / "x")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ck.CheckpointError, match="refusing to overwrite"):
        ck.save(str(tmp_path / "mine"), params, state, ss, engine)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_static_loss_scale_keeps_its_own_scale_on_load(saved):
    path, *_ = saved
    tx = transforms.adamw(lr=transforms.linear_warmup(1e-3, 1e-2, 3), weight_decay=0.1,
                          weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p))
    engine = fzero.zero1(tx, param_dtype=torch.bfloat16, loss_scale=None)  # resume FP16 run as BF16
    engine.init(model_params())
    params, state, ss, _ = ck.load(path, engine)
    assert float(ss.scale) == 1.0 and params["w"].dtype == torch.bfloat16


def test_export_full_round_trip_one_process(saved, tmp_path):
    path, engine, params, state, ss = saved
    ck.export_full(str(tmp_path / "p.safetensors"), params, engine)
    ck.export_full(str(tmp_path / "m.safetensors"), state, engine)
    got_p = load_file(str(tmp_path / "p.safetensors"))
    got_m = load_file(str(tmp_path / "m.safetensors"))
    paths, leaves, _ = fzero.flat.leaf_paths(params)
    masters = optree.tree_leaves(fzero.unflatten(state.master, engine.layout))
    for p, leaf, m in zip(paths, leaves, masters):
        assert got_p[p].dtype == torch.float16 and torch.equal(got_p[p], leaf)
        assert got_m[p].dtype == torch.float32 and torch.equal(got_m[p], m)
    assert sorted(got_p) == sorted(paths) == sorted(got_m)
    assert os.listdir(tmp_path).count("p.safetensors") == 1 and not glob.glob(str(tmp_path / "*.tmp-*"))


@pytest.mark.parametrize("old_n,new_n", [(2, 3), (3, 1), (1, 4), (4, 2)])
def test_each_rank_reads_exactly_its_real_elements(old_n, new_n):
    """Resharding plan only: rank r of the new world reads, over all old files, exactly the
    elements it owns (no padding, nothing twice), each into its own place in the shard."""
    p = model_params()
    glob_vec = torch.cat([x.reshape(-1) for x in optree.tree_leaves(p)])
    old = fzero.make_layout(p, old_n, alignment=8, bucket_numel=40)  # reversed buckets: many segments
    new = fzero.make_layout(p, new_n, alignment=64)
    old_segments = [old.owned(r) for r in range(old_n)]
    files = [{"segments": [[g0, g1] for g0, g1, _ in segs]} for segs in old_segments]
    new_segments = [new.owned(r) for r in range(new_n)]
    for r in range(new_n):
        shard = torch.zeros(new.shard_numel)
        hit = torch.zeros(new.shard_numel, dtype=torch.int32)
        for entry, segs in zip(files, old_segments):
            data = torch.cat([glob_vec[g0:g1] for g0, g1, _ in segs]) if segs else torch.zeros(0)
            for fpos, spos, m in reshard.overlaps(entry["segments"], new_segments[r]):
                shard[spos : spos + m] = data[fpos : fpos + m]
                hit[spos : spos + m] += 1
        assert torch.equal(shard, fzero.tree_shard(p, new, r, dtype=torch.float32))
        real = sum(g1 - g0 for g0, g1, _ in new_segments[r])
        assert int(hit.sum()) == real and int(hit.max()) <= 1
    # each file is hashed by the new rank that reads most of it (page cache), ties to the lowest
    for j, (entry, owner) in enumerate(zip(files, reshard.verifiers(files, new_segments))):
        seen = [sum(m for *_, m in reshard.overlaps(entry["segments"], segs)) for segs in new_segments]
        assert owner == (seen.index(max(seen)) if max(seen) else j % new_n)


# ------------------------------------------------------------------------ what a save may delete
def test_save_keeps_siblings_and_unknown_files_and_refuses_foreign_directories(saved, tmp_path):
    path, engine, params, state, ss = saved
    backup = tmp_path / "ckpt.old-manual-backup"  # names an earlier protocol used for itself
    shutil.copytree(path, backup)
    (tmp_path / "ckpt.tmp-notes").write_text("mine")
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    stray = tmp_path / "ckpt" / ("snapshot-" + "0" * 32)  # a snapshot name the marker does not record
    stray.mkdir()
    (stray / "keep.txt").write_text("mine")
    ours_before = set(os.listdir(backup))
    for v in range(3):
        ck.save(path, params, state, ss, engine, extra={"v": v})
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.old-manual-backup", "ckpt.tmp-notes"]
    assert set(os.listdir(backup)) == ours_before and (tmp_path / "ckpt.tmp-notes").read_text() == "mine"
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "mine" and (stray / "keep.txt").read_text() == "mine"
    assert entries(path) == sorted(COMMITTED + ["notes.txt", "snapshot-*"])
    # load never reads a sibling in place of a missing path
    shutil.rmtree(path)
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.load(path, fresh_engine())
    # a non-empty directory that is not fzero's, a file: refused, untouched
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.bin").write_bytes(b"x")
    with pytest.raises(ck.CheckpointError, match=r"refusing to overwrite .*data: it exists, is not empty and is not an fzero"):
        ck.save(str(tmp_path / "data"), params, state, ss, engine)
    assert os.listdir(tmp_path / "data") == ["x.bin"]
    with pytest.raises(ck.CheckpointError, match="refusing to overwrite .*ckpt.tmp-notes: it exists and is not a directory"):
        ck.save(str(tmp_path / "ckpt.tmp-notes"), params, state, ss, engine)
    (tmp_path / "empty").mkdir()  # an empty directory becomes a checkpoint
    ck.save(str(tmp_path / "empty"), params, state, ss, engine, extra={"v": "e"})
    assert ck.load(str(tmp_path / "empty"), fresh_engine())[3] == {"v": "e"}


def test_save_through_a_symlink_writes_into_its_target(saved, tmp_path):
    path, engine, params, state, ss = saved
    link, target = tmp_path / "link", tmp_path / "real"
    os.symlink(target, link)  # dangling: the first save creates the target
    for v in range(3):
        ck.save(str(link), params, state, ss, engine, extra={"v": v})
    assert os.path.islink(link) and os.readlink(link) == str(target)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "link", "real"]  # no temporary links or directories
    assert entries(target) == COMMITTED
    assert ck.load(str(link), fresh_engine())[3] == {"v": 2} == ck.load(str(target), fresh_engine())[3]
    other = tmp_path / "link2"
    os.symlink(path, other)  # a link to an existing checkpoint
    ck.save(str(other), params, state, ss, engine, extra={"v": "via link"})
    assert os.path.islink(other) and ck.load(path, fresh_engine())[3] == {"v": "via link"}


# ------------------------------------------------------------------------ loads racing saves
def tagged(state, ss, tag):
    """``state``/``ss`` with every part saying ``tag``: master and moments filled with it, both
    counts equal to it, weight decay ``tag / 100``, loss scale ``tag + 1``."""
    adam, decay, sched = state.tx_state
    count = torch.tensor(tag, dtype=torch.int32)
    adam = adam._replace(count=count, mu=torch.full_like(adam.mu, tag), nu=torch.full_like(adam.nu, tag))
    decay = decay._replace(inner=decay.inner._replace(weight_decay=torch.tensor(tag / 100, dtype=torch.float64)))
    state = fzero.ZeroState(torch.full_like(state.master, tag), (adam, decay, sched._replace(count=count)))
    return state, ss._replace(scale=torch.tensor(tag + 1.0))


def mixed_parts(engine, state, ss, extra):
    """The parts of a loaded checkpoint that do not say ``extra["tag"]`` (empty: consistent)."""
    tag = extra["tag"]
    real = torch.zeros(engine.layout.shard_numel, dtype=torch.bool)  # padding is not stored: zero
    for g0, g1, pos in engine.layout.owned(engine.comm.rank):
        real[pos : pos + g1 - g0] = True
    adam, decay, sched = state.tx_state
    checks = {
        "master": bool((state.master[real] == tag).all()),
        "mu": bool((adam.mu[real] == tag).all()),
        "nu": bool((adam.nu[real] == tag).all()),
        "count": int(adam.count) == tag,
        "schedule count": int(sched.count) == tag,
        "weight_decay": float(decay.inner.weight_decay) == tag / 100,
        "loss scale": float(ss.scale) == tag + 1,
    }
    return [name for name, ok in checks.items() if not ok]


def test_a_load_reads_one_snapshot_while_saves_commit(saved):
    path, engine, params, state, ss = saved
    original = global_view(engine, state, ss)
    p2, s2, ss2 = run_steps(engine, params, state, ss, range(3, 5))

    def save_once(point, **info):
        if point == "resolved":
            ck.save(path, p2, s2, ss2, engine, extra={"v": 2})

    fresh = fresh_engine()
    _, s, sc, extra = ck.load(path, fresh, _hook=save_once)  # the snapshot read is kept by that save
    assert extra == {"epoch": 1, "seen": [1, 2]}
    assert_views_equal(global_view(fresh, s, sc), original)
    assert ck.load(path, fresh)[3] == {"v": 2}

    for at in ("resolved", "verified"):  # two saves: the snapshot being read is deleted
        def save_twice(point, **info):
            if point == at:
                for v in (3, 4):
                    ck.save(path, p2, s2, ss2, engine, extra={"v": v})

        with pytest.raises(ck.CheckpointError, match=r"was replaced while loading: .*snapshot-\w+/(manifest.json|shard-\S+) is gone"):
            ck.load(path, fresh_engine(), _hook=save_twice)
    assert ck.load(path, fresh_engine())[3] == {"v": 4}


RACE_SECONDS, RACE_SAVES = 3.0, 40


def race_save_and_load(rank, world_size, tmp):
    """Rank 0 saves tagged states to one path, over and over; rank 1 loads it meanwhile. Each
    is a one-process engine (no group): two independent programs sharing a directory."""
    path, ready, done = (os.path.join(tmp, name) for name in ("ckpt", "ready", "done"))
    engine = make_engine()
    params, state, ss = engine.init(model_params())
    if rank == 0:
        ck.save(path, params, *tagged(state, ss, 0), engine, extra={"tag": 0})
        deadline = time.monotonic() + 60
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.01)
        tag, start = 1, time.monotonic()
        while tag < 3 or (tag < RACE_SAVES and time.monotonic() - start < RACE_SECONDS):
            ck.save(path, params, *tagged(state, ss, tag), engine, extra={"tag": tag})
            tag += 1
        with open(done, "w") as f:
            f.write(str(tag - 1))
        return {"saves": tag}
    out = {"loads": 0, "replaced": 0, "errors": [], "mixed": []}
    deadline = time.monotonic() + 90
    while not os.path.exists(os.path.join(path, commit.POINTER)) and time.monotonic() < deadline:
        time.sleep(0.01)
    open(ready, "w").close()
    finished = False
    while not finished and time.monotonic() < deadline:
        finished = os.path.exists(done)  # one more load after the last save
        try:
            _, s, sc, extra = ck.load(path, engine, hyperparams="checkpoint")
        except ck.CheckpointError as e:  # allowed: the snapshot went away (two saves) mid-load
            if "replaced while loading" in str(e):
                out["replaced"] += 1
            else:
                out["errors"].append(str(e))
            continue
        out["loads"] += 1
        mixed = mixed_parts(engine, s, sc, extra)
        if mixed:
            out["mixed"].append((extra["tag"], mixed))
        out["last"] = extra["tag"]
    out["final"] = int(open(done).read()) if os.path.exists(done) else None
    return out


def test_loads_racing_saves_are_never_mixed_nor_corrupted(tmp_path):
    saver, loader = run_ranks(race_save_and_load, 2, str(tmp_path), init=False, timeout=150)
    assert saver["saves"] >= 3
    assert loader["errors"] == [] and loader["mixed"] == [], loader
    assert loader["final"] == saver["saves"] - 1 and loader["last"] == loader["final"]  # the load after the last save
    assert loader["loads"] >= 1
    assert entries(str(tmp_path / "ckpt")) == COMMITTED


# ------------------------------------------------------------------------ manifest validation
def edit_manifest(path, edit):
    """Rewrite the current manifest's text with ``edit(text)`` and put its sha256 in the pointer,
    so that only the validation of its values can catch the change."""
    file = os.path.join(snapshot_dir(path), "manifest.json")
    with open(file) as f:
        text = edit(f.read())
    with open(file, "w") as f:
        f.write(text)
    pointer = os.path.join(path, commit.POINTER)
    with open(pointer) as f:
        p = json.load(f)
    p["manifest_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    with open(pointer, "w") as f:
        json.dump(p, f)


def edit_fields(path, change):
    """``change(manifest)`` on the parsed manifest, written back (see ``edit_manifest``)."""
    def edit(text):
        m = json.loads(text)
        change(m)
        return json.dumps(m, indent=1)

    edit_manifest(path, edit)


def set_scalar(name, value):
    def change(m):
        (entry,) = [e for e in m["state"] if e["name"] == name]
        entry["value"] = value

    return change


def set_at(value, *keys):
    def change(m):
        for k in keys[:-1]:
            m = m[k]
        m[keys[-1]] = value

    return change


def add_scalar(name, value, dtype="float64"):
    return lambda m: m["state"].append({"name": name, "kind": "scalar", "dtype": dtype, "value": value})


BAD_MANIFESTS = {
    "b2 >= 1": (set_scalar("tx_state/0/b2", 1.5), r"state\['tx_state/0/b2'\]\.value = 1\.5: must be in \[0, 1\)"),
    "b1 < 0": (set_scalar("tx_state/0/b1", -0.1), r"state\['tx_state/0/b1'\]\.value = -0\.1: must be in \[0, 1\)"),
    "b2 nan": (set_scalar("tx_state/0/b2", "nan"), r"state\['tx_state/0/b2'\]\.value = 'nan': must be in \[0, 1\)"),
    "eps < 0": (set_scalar("tx_state/0/eps", -1e-8), r"state\['tx_state/0/eps'\]\.value = -1e-08: must be a finite number >= 0"),
    "weight decay inf": (set_scalar("tx_state/1/inner/weight_decay", "inf"),
                         r"state\['tx_state/1/inner/weight_decay'\]\.value = 'inf': must be a finite number >= 0"),
    "lr < 0": (add_scalar("tx_state/3/lr", -1.0), r"state\['tx_state/3/lr'\]\.value = -1\.0: must be a finite number >= 0"),
    "max_norm 0": (add_scalar("tx_state/3/max_norm", 0.0), r"state\['tx_state/3/max_norm'\]\.value = 0\.0: must be a finite number > 0"),
    "max_norm inf": (add_scalar("tx_state/3/max_norm", "inf"), r"state\['tx_state/3/max_norm'\]\.value = 'inf': must be a finite number > 0"),
    "momentum < 0": (add_scalar("tx_state/3/momentum", -0.5), r"state\['tx_state/3/momentum'\]\.value = -0\.5: must be a finite number >= 0"),
    "count < 0": (set_scalar("tx_state/0/count", -1), r"state\['tx_state/0/count'\]\.value = -1: must be a non-negative integer"),
    "count float": (set_scalar("tx_state/0/count", 2.5), r"state\['tx_state/0/count'\]\.value = 2\.5: must be an integer \(an int32 leaf\)"),
    "count list": (set_scalar("tx_state/2/count", [2]), r"state\['tx_state/2/count'\]\.value = \[2\]: must be an integer"),
    "count too big": (set_scalar("tx_state/2/count", 2**40), r"state\['tx_state/2/count'\]\.value = 1099511627776: must be in the int32 range"),
    "hyperparameter dict": (set_scalar("tx_state/0/b2", {"v": 0.9}), r"state\['tx_state/0/b2'\]\.value = \{'v': 0\.9\}: must be a number"),
    "hyperparameter string": (set_scalar("tx_state/0/b2", "0.9"), r"state\['tx_state/0/b2'\]\.value = '0\.9': must be a number"),
    "unknown dtype": (lambda m: m["state"][0].update(dtype="float128"), r"state\['master'\]\.dtype = 'float128': must be one of"),
    "duplicate leaf": (lambda m: m["state"].append(dict(m["state"][0])), r"state\[\d+\]\.name = 'master': must be unique"),
    "kind": (lambda m: m["state"][0].update(kind="blob"), r"state\['master'\]\.kind = 'blob': must be one of"),
    "scale nan": (set_at("nan", "loss_scale", "scale"), r"loss_scale\.scale = 'nan': must be a finite number > 0"),
    "scale 0": (set_at(0, "loss_scale", "scale"), r"loss_scale\.scale = 0: must be a finite number > 0"),
    "scale above max_scale": (set_at(2.0**30, "loss_scale", "scale"),
                              r"loss_scale\.scale = 1073741824\.0: must be in \[min_scale, max_scale\] = \[1\.0, 16777216\.0\]"),
    "scale below min_scale": (set_at(0.5, "loss_scale", "scale"), r"loss_scale\.scale = 0\.5: must be in \[min_scale"),
    "good_steps < 0": (set_at(-1, "loss_scale", "good_steps"), r"loss_scale\.good_steps = -1: must be in \[0, 2147483647\]"),
    "hysteresis float": (set_at(1.0, "loss_scale", "hysteresis"), r"loss_scale\.hysteresis = 1\.0: must be an integer"),
    "stuck_steps bool": (set_at(True, "loss_scale", "stuck_steps"), r"loss_scale\.stuck_steps = True: must be an integer"),
    "param dtype": (set_at("int8", "param_dtype"), r"param_dtype = 'int8': must be one of"),
    "bytes string": (lambda m: m["files"][0].update(bytes="1234"), r"files\[0\]\.bytes = '1234': must be an integer"),
    "bytes bool": (lambda m: m["files"][0].update(bytes=True), r"files\[0\]\.bytes = True: must be an integer"),
    "segment float": (lambda m: m["files"][0].update(segments=[[0, 446.0]]), r"files\[0\]\.segments\[0\]\[1\] = 446\.0: must be an integer"),
    "segment gap": (lambda m: m["files"][0].update(segments=[[0, 400]]), r"files\[\*\]\.segments = 400: .* cover all 446"),
    "file name": (lambda m: m["files"][0].update(file="../x.safetensors"), r"files\[0\]\.file = '\.\./x\.safetensors': must be a plain"),
    "sha256": (lambda m: m["files"][0].update(sha256="abc"), r"files\[0\]\.sha256 = 'abc': must match"),
    "shape float": (lambda m: m["layout"]["leaves"][0].update(shape=[13.0]), r"layout\.leaves\[0\]\.shape\[0\] = 13\.0: must be an integer"),
    "numel": (set_at(445, "layout", "numel"), r"layout\.numel = 445: must be 446"),
    "world size": (set_at(0, "world_size"), r"world_size = 0: must be >= 1"),
    "step": (set_at(-3, "step"), r"step = -3: must be >= 0"),
    "extra": (set_at([1], "extra"), r"extra = \[1\]: must be a JSON object"),
    "missing field": (lambda m: m.pop("files"), r"files is missing"),
}


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_manifest_values_are_validated_and_named(saved, case):
    path, *_ = saved
    change, want = BAD_MANIFESTS[case]
    ck.load(path, fresh_engine())  # as saved: fine
    edit_fields(path, change)
    with pytest.raises(ck.CheckpointError, match=r"manifest\.json: manifest field " + want):
        ck.load(path, fresh_engine())


@pytest.mark.parametrize("token,want", [
    ("NaN", "non-standard JSON token NaN"),
    ("-Infinity", "non-standard JSON token -Infinity"),
    ("1e400", "number 1e400 is out of the float64 range"),
])
def test_manifest_is_parsed_as_strict_json(saved, token, want):
    path, *_ = saved
    edit_manifest(path, lambda text: re.sub(r'"value": 0\.999\b', f'"value": {token}', text, count=1))
    for read in (lambda: ck.load(path, fresh_engine()), lambda: ck.read_manifest(path)):
        with pytest.raises(ck.CheckpointError, match=rf"cannot read .*manifest\.json: {want}"):
            read()


def test_manifest_with_a_duplicate_key_is_refused(saved):
    path, *_ = saved
    edit_manifest(path, lambda text: text.replace('"format": "fzero-checkpoint",', '"format": "fzero-checkpoint", "step": 1,', 1))
    with pytest.raises(ck.CheckpointError, match=r"cannot read .*manifest\.json: duplicate key 'step'"):
        ck.load(path, fresh_engine())


def test_save_refuses_what_load_would_refuse(saved):
    path, engine, params, state, ss = saved
    for extra, want in [({"hist": [1.0, float("nan")]}, r"extra\['hist'\]\[1\] = nan"),
                        ({"best": {"loss": float("-inf")}}, r"extra\['best'\]\['loss'\] = -inf")]:
        with pytest.raises(ck.CheckpointError, match=want + ": JSON has no NaN or infinity"):
            ck.save(path, params, state, ss, engine, extra=extra)
    adam = state.tx_state[0]._replace(b2=torch.tensor(1.5, dtype=torch.float64))
    bad = state._replace(tx_state=(adam, *state.tx_state[1:]))
    with pytest.raises(ck.CheckpointError, match=r"manifest field state\['tx_state/0/b2'\]\.value = 1\.5: must be in \[0, 1\)"):
        ck.save(path, params, bad, ss, engine)
    # nothing was committed, no snapshot left behind
    assert entries(path) == ONE
    assert ck.load(path, fresh_engine())[3] == {"epoch": 1, "seen": [1, 2]}


# ------------------------------------------------------------------------ hyperparameters on load
def constant_lr_engine(lr=1e-3, weight_decay=0.1, **kw):
    tx = transforms.adamw(lr=lr, weight_decay=weight_decay, **kw)
    return fzero.zero1(tx, param_dtype=torch.float16, loss_scale=fzero.DynamicLossScale(init_scale=16.0))


def test_load_keeps_the_engines_hyperparameters_and_warns_about_each_difference(saved):
    path, engine, params, state, ss = saved  # weight decay 0.1
    tx = transforms.adamw(lr=transforms.linear_warmup(1e-3, 1e-2, 3), weight_decay=0.5, betas=(0.8, 0.999),
                          weight_decay_mask=lambda p: optree.tree_map(lambda x: x.ndim > 1, p))
    other = fzero.zero1(tx, param_dtype=torch.float16, loss_scale=fzero.DynamicLossScale(init_scale=16.0))
    other.init(model_params(seed=1))
    with pytest.warns(UserWarning) as record:
        _, s2, ss2, _ = ck.load(path, other)
    assert len(record) == 1
    msg = str(record[0].message)
    assert "tx_state/1/inner/weight_decay: checkpoint 0.1, engine 0.5" in msg
    assert "tx_state/0/b1: checkpoint 0.9, engine 0.8" in msg and "b2" not in msg and 'hyperparams="checkpoint"' in msg
    got = transforms.get_hyperparams(s2)
    assert float(got["weight_decay"]) == 0.5 and float(got["b1"]) == 0.8 and float(got["b2"]) == 0.999
    # everything else comes from the checkpoint
    view, saved_view = global_view(other, s2, ss2), global_view(engine, state, ss)
    for name in ("tx_state/1/inner/weight_decay", "tx_state/0/b1"):
        del view[name], saved_view[name]
    assert_views_equal(view, saved_view)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, s3, _, _ = ck.load(path, other, hyperparams="checkpoint")
    assert float(transforms.get_hyperparams(s3)["weight_decay"]) == 0.1 and float(transforms.get_hyperparams(s3)["b1"]) == 0.9
    with pytest.raises(ValueError, match="hyperparams must be one of"):
        ck.load(path, other, hyperparams="saved")


def test_hyperparams_checkpoint_restores_values_set_during_training(tmp_path):
    path = str(tmp_path / "ckpt")
    engine = constant_lr_engine()
    params, state, ss = engine.init(model_params())
    params, state, ss = run_steps(engine, params, state, ss, range(2))
    state = transforms.set_hyperparams(state, lr=2.5e-4)  # e.g. lowered by hand mid-run
    ck.save(path, params, state, ss, engine)

    fresh = constant_lr_engine()
    fresh.init(model_params(seed=1))
    _, s2, _, _ = ck.load(path, fresh, hyperparams="checkpoint")
    assert float(transforms.get_hyperparams(s2)["lr"]) == 2.5e-4
    with pytest.warns(UserWarning, match=r"tx_state/2/lr: checkpoint 0\.00025, engine 0\.001"):
        _, s3, _, _ = ck.load(path, fresh)
    assert float(transforms.get_hyperparams(s3)["lr"]) == 1e-3
    assert int(s3.tx_state[0].count) == int(state.tx_state[0].count) == 1  # step BAD was skipped


def test_no_warning_when_the_hyperparameters_agree(saved):
    path, *_ = saved
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.load(path, fresh_engine())
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("hyperparams", ["engine", "checkpoint"])
def test_a_loaded_state_keeps_the_fused_adamw_path(saved, hyperparams, monkeypatch):
    """Loaded hyperparameters carry their host values, so the eager step still runs torch's
    fused kernel (no device read for b1, b2, eps)."""
    path, engine, params, state, ss = saved
    calls, kernel = [], torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(1), kernel(*a, **k))[1])
    fresh = fresh_engine()
    p, s, sc, _ = ck.load(path, fresh, hyperparams=hyperparams)
    assert all(transforms.host_value(t) is not None for _, t in transforms.iter_hyperparams(s.tx_state))
    run_steps(fresh, p, s, sc, [7])
    assert calls == [1]


# ------------------------------------------------------------------------ saves to one path exclude each other
def contents(path):
    """Every file under ``path`` (hidden ones too) and its bytes."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            with open(file, "rb") as f:
                out[os.path.relpath(file, path)] = f.read()
    return out


def test_a_save_while_another_is_in_progress_fails_and_changes_nothing(saved):
    path, engine, params, state, ss = saved
    p2, s2, ss2 = run_steps(engine, params, state, ss, range(3, 5))
    seen = {}

    def contend(point, **info):
        if point == "shard_written":  # the first save holds the lock: a second one on the same path
            before = contents(path)
            with pytest.raises(ck.CheckpointError) as e:
                ck.save(path, p2, s2, ss2, engine, extra={"v": "second"})
            seen["error"], seen["unchanged"] = str(e.value), contents(path) == before

    ck.save(path, params, state, ss, engine, extra={"v": "first"}, _hook=contend)
    assert seen["unchanged"]
    assert seen["error"].startswith(f"another save to {path} is in progress (pid {os.getpid()} on "), seen["error"]
    assert "this save changed nothing" in seen["error"]
    assert entries(path) == COMMITTED and ck.load(path, fresh_engine())[3] == {"v": "first"}


HAMMER_SECONDS = 2.0


def hammer_saves(rank, world_size, tmp):
    """Two independent one-process jobs (no group) saving to one path as fast as they can, as
    the orphaned workers of a killed launcher do; each save's tag says which job wrote it."""
    path = os.path.join(tmp, "ckpt")
    engine = make_engine()
    params, state, ss = engine.init(model_params())
    open(os.path.join(tmp, f"ready{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(tmp, f"ready{r}")) for r in range(world_size)):
        time.sleep(0.01)
    out = {"saved": [], "refused": 0, "errors": []}
    start, i = time.monotonic(), 0
    while time.monotonic() - start < HAMMER_SECONDS:
        tag = 1000 * (rank + 1) + i
        i += 1
        try:
            ck.save(path, params, *tagged(state, ss, tag), engine, extra={"tag": tag})
            out["saved"].append(tag)
        except ck.CheckpointError as e:
            if str(e).startswith(f"another save to {path} is in progress ("):
                out["refused"] += 1
            else:
                out["errors"].append(str(e))
    return out


def test_concurrent_savers_exclude_each_other_and_leave_no_orphans(tmp_path):
    path = str(tmp_path / "ckpt")
    engine = make_engine()
    params, state, ss = engine.init(model_params())
    ck.save(path, params, *tagged(state, ss, 1), engine, extra={"tag": 1})  # the previous checkpoint
    jobs = run_ranks(hammer_saves, 2, str(tmp_path), init=False, timeout=120)
    assert [j["errors"] for j in jobs] == [[], []], jobs
    saved_tags = {1} | {t for j in jobs for t in j["saved"]}
    _, s, sc, extra = ck.load(path, engine, hyperparams="checkpoint")
    assert extra["tag"] in saved_tags and mixed_parts(engine, s, sc, extra) == []
    assert len(saved_tags) >= 3
    ck.save(path, params, *tagged(state, ss, 2), engine, extra={"tag": 2})
    assert entries(path) == COMMITTED  # no snapshot left behind by either job


def save_then_die(rank, world_size, path):
    engine = make_engine()
    params, state, ss = trained(engine, 2)

    def die(point, **info):
        if point == "shard_written":
            os.kill(os.getpid(), signal.SIGKILL)  # holding the lock

    ck.save(path, params, state, ss, engine, extra={"v": "dead"}, _hook=die)


def test_a_saver_killed_holding_the_lock_does_not_block_the_next_save(saved):
    path, engine, params, state, ss = saved
    assert run_ranks(save_then_die, 1, path, init=False, may_die=(0,)) == [None]
    assert ck.load(path, fresh_engine())[3] == {"epoch": 1, "seen": [1, 2]}
    ck.save(path, params, state, ss, engine, extra={"v": "next"})  # the kernel dropped the dead one's lock
    assert entries(path) == COMMITTED and ck.load(path, fresh_engine())[3] == {"v": "next"}


# ------------------------------------------------------------------------ a damaged pointer
def damage_pointer(path, how):
    pointer = os.path.join(path, commit.POINTER)
    if how == "deleted":
        os.remove(pointer)
    else:
        os.truncate(pointer, os.path.getsize(pointer) // 2)


@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_a_damaged_pointer_keeps_the_intact_snapshot_and_recover_restores_it(saved, how):
    path, engine, params, state, ss = saved
    original, good = global_view(engine, state, ss), os.path.basename(snapshot_dir(path))
    damage_pointer(path, how)
    with pytest.raises(ck.CheckpointError) as e:
        ck.load(path, fresh_engine())
    msg = str(e.value)
    assert f"{good} (no step)" in msg and f"fzero.checkpoint.recover({path!r})" in msg, msg
    assert ck.recover(path) == good  # verifies it, points current.json at it
    _, s, sc, _ = ck.load(path, fresh_engine())
    assert_views_equal(global_view(engine, s, sc), original)

    damage_pointer(path, how)  # a save now keeps it (it cannot tell which snapshot was current)
    p2, s2, ss2 = run_steps(engine, params, state, ss, range(3, 5))
    with pytest.warns(UserWarning, match=rf"kept {good}"):
        ck.save(path, p2, s2, ss2, engine, extra={"step": 5})
    assert good in os.listdir(path) and ck.load(path, fresh_engine())[3] == {"step": 5}
    assert ck.recover(path, good) == good  # go back to it by name
    _, s, sc, _ = ck.load(path, fresh_engine())
    assert_views_equal(global_view(engine, s, sc), original)


def test_recover_verifies_the_snapshot_first(saved):
    path, engine, params, state, ss = saved
    good = os.path.basename(snapshot_dir(path))
    damage_pointer(path, "deleted")
    flip_byte(shard_files_of(path, good)[0])
    before = contents(path)
    with pytest.raises(ck.CheckpointError, match=rf"{good}/shard-00000-of-00001.safetensors is corrupted"):
        ck.recover(path, good)
    with pytest.raises(ck.CheckpointError, match=rf"no snapshot in {re.escape(path)} passes verification: {good}: .* is corrupted"):
        ck.recover(path)
    with pytest.raises(ck.CheckpointError, match=r"no snapshot 'snapshot-0+' in"):
        ck.recover(path, "snapshot-" + "0" * 32)
    assert contents(path) == before  # nothing re-pointed


def shard_files_of(path, snapshot):
    return sorted(glob.glob(os.path.join(path, snapshot, "shard-*.safetensors")))


# ------------------------------------------------------------------------ what save accepts
@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_save_accepts_the_flat_buffer_that_step_accepts(tmp_path, master):
    kw = {"master": "remainder", "param_dtype": torch.bfloat16} if master == "remainder" else {}
    engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1), **{"param_dtype": torch.float16, **kw})
    params, state, ss = engine.init(model_params())
    flat = engine.flat_params(params)
    grads = optree.tree_map(lambda g: g.to(engine.param_dtype), grads_like(model_params(), 1))
    flat, state, ss, _ = engine.step(flat, fzero.flatten(grads, engine.layout), state, ss)
    ck.save(str(tmp_path / "flat"), flat, state, ss, engine)
    ck.save(str(tmp_path / "tree"), fzero.unflatten(flat, engine.layout), state, ss, engine)
    got = {}
    for name in ("flat", "tree"):
        _, s, sc, _ = ck.load(str(tmp_path / name), engine)
        got[name] = optree.tree_leaves((s, sc))
    assert all(torch.equal(a, b) for a, b in zip(got["flat"], got["tree"]))
    assert torch.equal(got["flat"][0], state.master)  # the stored master: FP32 or the remainder, as saved
    with pytest.raises(ck.CheckpointError, match=r"flat params have dtype torch.float32, expected torch.(b?float16)"):
        ck.save(str(tmp_path / "fp32"), flat.float(), state, ss, engine)  # checked as step checks it
    assert not os.path.exists(tmp_path / "fp32")


@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_save_refuses_params_of_another_step_or_edited_and_writes_nothing(tmp_path, master):
    """With the remainder master the saved FP32 master is rebuilt from the params: init's params
    with the state of five steps later wrote a master 0.049 off. Params written in place since
    the step would be lost (FP32 master) or mixed in (remainder): both modes refuse."""
    engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1), param_dtype=torch.bfloat16, master=master)
    params0, state, ss = engine.init(model_params())
    params = params0
    for i in range(5):
        grads = optree.tree_map(lambda g: g.to(torch.bfloat16), grads_like(model_params(), i))
        params, state, ss, _ = engine.step(params, grads, state, ss)
    path = str(tmp_path / "ck")
    ck.save(path, params, state, ss, engine)
    before = sorted(os.listdir(path))
    if master == "remainder":
        with pytest.raises(ck.CheckpointError, match="checkpoint.save: these params were not written together with this state"):
            ck.save(path, params0, state, ss, engine)
    else:  # the FP32 master does not read them
        ck.save(str(tmp_path / "other"), params0, state, ss, engine)
    with torch.no_grad():
        params["w"].zero_()
    with pytest.raises(ck.CheckpointError, match="checkpoint.save: the params were written in place"):
        ck.save(path, params, state, ss, engine)
    assert sorted(os.listdir(path)) == before  # nothing written, the checkpoint as it was
    _, loaded, _, _ = ck.load(path, engine)
    assert torch.equal(loaded.master, state.master)


# ------------------------------------------------------------------------ two ranks: a locked path, different paths, masks
def mask_without_w(p):
    """Like ``make_engine``'s mask, but ``w`` does not decay and ``z`` only in its first 5 rows."""
    out = optree.tree_map(lambda x: x.ndim > 1, p)
    out["w"] = False
    out["z"] = (torch.arange(p["z"].shape[0]) < 5)[:, None].expand(p["z"].shape)
    return out


def other_mask_engine():
    tx = transforms.adamw(lr=transforms.linear_warmup(1e-3, 1e-2, 3), weight_decay=0.1, weight_decay_mask=mask_without_w)
    return fzero.zero1(tx, param_dtype=torch.float16, loss_scale=fzero.DynamicLossScale(init_scale=16.0))


def two_ranks(rank, world_size, tmp):
    engine = make_engine()
    params, state, ss = trained(engine, 2)
    try:
        ck.save(os.path.join(tmp, "locked"), params, state, ss, engine)
        out = {"locked": "saved"}
    except ck.CheckpointError as e:
        out = {"locked": str(e)}
    out["different"] = load_error(os.path.join(tmp, f"c{rank}"), engine)
    out["copy"] = load_error(os.path.join(tmp, "c0" if rank == 0 else "c0_copy"), engine)
    other = other_mask_engine()
    _, fresh_state, fresh_ss = other.init(model_params(seed=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, s, sc, _ = ck.load(os.path.join(tmp, "c0"), other)
    out["warnings"] = [str(w.message) for w in caught]
    out["engine_mask"] = global_view(other, s, sc)["tx_state/1/mask"]
    out["fresh_mask"] = global_view(other, fresh_state, fresh_ss)["tx_state/1/mask"]
    _, s, sc, _ = ck.load(os.path.join(tmp, "c0"), other, hyperparams="checkpoint")
    out["saved_mask"] = global_view(other, s, sc)["tx_state/1/mask"]
    return out


def test_two_ranks_a_locked_path_different_paths_and_a_changed_mask(tmp_path):
    """One 2-rank job: a save to a path another job is saving to fails on every rank and changes
    nothing; a load whose ranks were given different checkpoints says so, naming each rank's
    path (a copy reached by another path is the same checkpoint: fine); a weight-decay mask
    that differs from the checkpoint's follows the hyperparameters' rule, named leaf by leaf."""
    tmp = str(tmp_path)
    for name, seed in (("locked", 2), ("c0", 0), ("c1", 1)):
        engine = make_engine()
        params, state, ss = trained(engine, 3, seed=seed)
        ck.save(os.path.join(tmp, name), params, state, ss, engine, extra={"v": name})
    shutil.copytree(os.path.join(tmp, "c0"), os.path.join(tmp, "c0_copy"))
    saved_mask = global_view(engine, state, ss)["tx_state/1/mask"]  # c0's and c1's
    locked = os.path.join(tmp, "locked")
    held = lock.acquire(locked)  # another job's save in progress (this process)
    try:
        before = contents(locked)
        r = run_ranks(two_ranks, 2, tmp)
        assert contents(locked) == before
    finally:
        lock.release(held)
    assert r[0]["locked"] == r[1]["locked"], r  # agreed: every rank raised the same error
    assert r[0]["locked"].startswith(f"save {locked}: rank 0: another save to {locked} is in progress (pid {os.getpid()} ")
    assert ck.load(locked, fresh_engine())[3] == {"v": "locked"}  # the previous checkpoint

    assert r[0]["different"] == r[1]["different"], r
    msg = r[0]["different"]
    assert "the ranks were given different checkpoints" in msg and "replaced" not in msg, msg
    assert f"rank 0: {tmp}/c0;" in msg and f"rank 1: {tmp}/c1 (has no snapshot-" in msg, msg
    assert r[0]["copy"] == r[1]["copy"] == "no error"

    (warning,) = r[0]["warnings"]
    assert r[1]["warnings"] == []  # rank 0 warns, once, for every rank
    assert "tx_state/1/mask[w]: checkpoint True, engine False" in warning, warning
    assert "tx_state/1/mask[z]: checkpoint True on 391 of 391 elements, engine on 115" in warning, warning
    assert "blocks" not in warning and 'hyperparams="checkpoint"' in warning, warning
    for rank in r:
        assert torch.equal(rank["engine_mask"], rank["fresh_mask"])  # the engine's mask takes effect
        assert torch.equal(rank["saved_mask"], saved_mask)  # or the checkpoint's, when asked
    assert not torch.equal(saved_mask, r[0]["fresh_mask"])
