"""Checkpoints: world-size-independent round trips, exact resume, crash safety, errors, export.

The multi-rank runs are few and batched (one spawn per world size): the 2 -> 3 -> 1 -> 4 chain
checks, at each link, that the loaded global state is bitwise the saved one, that resuming
matches training straight through (bitwise at the same world size, 1e-6 at another), and
that errors are raised on every rank. Crash points are simulated in-process by a hook that
raises a ``BaseException`` the save does not catch (the files are then exactly as a kill
leaves them); one spawned run really kills a rank in the middle of its write.
"""
import glob
import inspect
import json
import os
import re
import shutil

import optree
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import fzero
import transforms
from distributed import run_ranks
from fzero import checkpoint as ck
from test_engine import grads_like, odd_params

K, M = 4, 3  # save after K steps, then M more per link of the chain
BAD = 1  # every rank sees an inf at this step: skipped, and the loss scale backs off
# several buckets (the engine's keyword has been bucket_numel, then bucket_bytes)
BUCKETS = {"bucket_bytes": 24} if "bucket_bytes" in inspect.signature(fzero.zero1).parameters else {"bucket_numel": 12}


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
    names, leaves, _ = ck._state_paths(state)
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


def shard_files(path):
    return sorted(glob.glob(os.path.join(path, "shard-*.safetensors")))


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
        os.remove(os.path.join(c + "_missing", "shard-00001-of-00002.safetensors"))
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
    }


def stage_b(rank, world_size, tmp):
    """World 3, another alignment and several buckets: errors agreed by all ranks, then load c."""
    c = os.path.join(tmp, "c")
    if rank == 0:  # a copy with a flipped byte in the data of rank 1's shard
        shutil.copytree(c, c + "_bad")
        flip_byte(os.path.join(c + "_bad", "shard-00001-of-00002.safetensors"))
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
    # no temporary or old directories left once the saves finished
    assert not [f for f in a["listing"] if ".tmp-" in f or ".old-" in f], a["listing"]

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

    # nothing pickled: JSON manifests and safetensors files only
    for path in glob.glob(os.path.join(tmp, "c*")):
        for name in os.listdir(path):
            file = os.path.join(path, name)
            with open(file, "rb") as f:
                head = f.read(9)
            assert head[:1] != b"\x80" and head[:2] != b"PK", file  # no pickle, no torch.save zip
            if name == "manifest.json":
                json.loads(open(file).read())
            else:
                assert name.endswith(".safetensors") and head[8:9] == b"{", file
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
    "point,exchange",
    [("tmp_created", True), ("shard_written", True), ("manifest_written", True),
     ("between_renames", False), ("committed", True)],
)
def test_crash_at_any_point_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, point, exchange):
    path = str(tmp_path / "ckpt")
    engine = make_engine()
    params, state, ss = trained(engine, 2)
    ck.save(path, params, state, ss, engine, extra={"v": 1})
    old = global_view(engine, state, ss)
    params, state, ss = run_steps(engine, params, state, ss, range(2, 4))
    new = global_view(engine, state, ss)

    monkeypatch.setattr(ck, "_use_exchange", exchange)
    monkeypatch.setattr(ck, "_test_hook", crash_at(point, truncate=point == "shard_written"))
    with pytest.raises(Killed):
        ck.save(path, params, state, ss, engine, extra={"v": 2})
    monkeypatch.setattr(ck, "_test_hook", None)

    fresh = make_engine()
    fresh.init(model_params(seed=9))
    if point == "between_renames":  # path is gone for an instant; load reads the .old-* copy
        assert not os.path.exists(path)
        with pytest.warns(UserWarning, match="interrupted"):
            _, s2, ss2, extra = ck.load(path, fresh)
    else:
        _, s2, ss2, extra = ck.load(path, fresh)
        assert sorted(os.listdir(path)) == ["manifest.json", "shard-00000-of-00001.safetensors"]
    committed = point == "committed"
    assert extra == {"v": 2 if committed else 1}
    assert_views_equal(global_view(fresh, s2, ss2), new if committed else old)

    # the next save puts things right and leaves nothing else next to path
    ck.save(path, params, state, ss, engine, extra={"v": 3})
    assert os.listdir(tmp_path) == ["ckpt"]
    assert ck.load(path, fresh)[3] == {"v": 3}


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

    ck._test_hook = die
    try:
        ck.save(path, params, state, ss, engine, extra={"v": 2})
    except ck.CheckpointError as e:  # rank 0 learns from the group that rank 1 is gone
        return str(e)
    return "saved"


def test_rank_killed_mid_write_keeps_previous_checkpoint(tmp_path):
    msg, dead = run_ranks(crash_rank1_mid_write, 2, str(tmp_path), timeout=90, may_die=(1,))
    assert dead is None and msg.startswith("save ") and "did one die?" in msg, msg
    path = str(tmp_path / "ckpt")
    assert sorted(os.listdir(path)) == ["manifest.json"] + [f"shard-0000{r}-of-00002.safetensors" for r in range(2)]
    assert not glob.glob(path + ".tmp-*")  # the surviving rank 0 removed the partial directory
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
    shard = shard_files(path)[0]
    for name, damage, want in [
        ("flip", lambda d: flip_byte(os.path.join(d, os.path.basename(shard))), "is corrupted: sha256"),
        ("cut", lambda d: os.truncate(os.path.join(d, os.path.basename(shard)), 100), "has 100 bytes"),
        ("gone", lambda d: os.remove(os.path.join(d, os.path.basename(shard))), "is missing"),
    ]:
        bad = f"{path}_{name}"
        shutil.copytree(path, bad)
        damage(bad)
        with pytest.raises(ck.CheckpointError, match=want) as e:
            ck.load(bad, fresh_engine())
        assert os.path.join(bad, os.path.basename(shard)) in str(e.value)
    # a flipped byte in the data is caught by the checksum only: with verify=False it loads
    flipped = f"{path}_flip"
    ck.load(flipped, fresh_engine(), verify=False)

    os.remove(os.path.join(f"{path}_cut", "manifest.json"))
    with pytest.raises(ck.CheckpointError, match="manifest.json is missing"):
        ck.load(f"{path}_cut", fresh_engine())
    with open(os.path.join(path + "_gone", "manifest.json"), "w") as f:
        f.write('{"format": "fzero-checkpoint", "vers')
    with pytest.raises(ck.CheckpointError, match=r"cannot read .*_gone/manifest.json"):
        ck.load(path + "_gone", fresh_engine())
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
    assert m["format"] == "fzero-checkpoint" and m["version"] == 1 and m["world_size"] == 1
    assert m["param_dtype"] == "float16" and m["step"] == 2  # 3 steps, one skipped
    assert [(e["path"], e["shape"], e["offset"]) for e in m["layout"]["leaves"]] == [
        ("blocks/0/g", [13], 0), ("blocks/1/g", [3, 1, 2], 13), ("one", [1], 19), ("w", [7, 5], 20), ("z", [17, 23], 55)]
    scalars = {e["name"]: e["value"] for e in m["state"] if e["kind"] == "scalar"}
    assert scalars["tx_state/0/b2"] == 0.999 and scalars["tx_state/1/inner/weight_decay"] == 0.1
    assert m["loss_scale"]["scale"] == float(ss.scale) and m["extra"] == {"epoch": 1, "seen": [1, 2]}
    (entry,) = m["files"]
    assert entry["segments"] == [[0, 446]] and len(entry["sha256"]) == 64
    tensors = load_file(os.path.join(path, entry["file"]))
    assert sorted(tensors) == ["master", "tx_state/0/mu", "tx_state/0/nu", "tx_state/1/mask"]
    assert tensors["tx_state/1/mask"].dtype == torch.bool and tensors["master"].shape == (446,)  # no padding


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
    files = [{"segments": [[g0, g1] for g0, g1, _ in segs]} for segs in ck._rank_segments(old)]
    new_segments = ck._rank_segments(new)
    for r in range(new_n):
        shard = torch.zeros(new.shard_numel)
        hit = torch.zeros(new.shard_numel, dtype=torch.int32)
        for entry, segs in zip(files, ck._rank_segments(old)):
            data = torch.cat([glob_vec[g0:g1] for g0, g1, _ in segs]) if segs else torch.zeros(0)
            for fpos, spos, m in ck._overlaps(entry["segments"], new_segments[r]):
                shard[spos : spos + m] = data[fpos : fpos + m]
                hit[spos : spos + m] += 1
        assert torch.equal(shard, fzero.tree_shard(p, new, r, dtype=torch.float32))
        real = sum(g1 - g0 for g0, g1, _ in new_segments[r])
        assert int(hit.sum()) == real and int(hit.max()) <= 1
    # each file is hashed by the new rank that reads most of it (page cache), ties to the lowest
    for j, (entry, owner) in enumerate(zip(files, ck._verifiers(files, new_segments))):
        seen = [sum(m for *_, m in ck._overlaps(entry["segments"], segs)) for segs in new_segments]
        assert owner == (seen.index(max(seen)) if max(seen) else j % new_n)
