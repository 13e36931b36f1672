"""Checkpoints through the public API: world-size-independent round trips, exact resume, what
save accepts, export_full, and one 2-rank job for a locked path, different paths and a changed mask.

The multi-rank runs are few and batched (one spawn per world size): the 2 -> 3 -> 1 -> 4 chain
checks, at each link, that the loaded global state is bitwise the saved one, that resuming
matches training straight through (bitwise at the same world size, 1e-6 at another), and
that errors are raised on every rank. The commit protocol, the save lock, the manifest, a
snapshot's checks and resharding have their own test files (``test_checkpoint_*.py``).
"""
import glob
import json
import os
import re
import shutil
import warnings

import optree
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import fzero
from fzero import transforms
from fzero.transforms.tree import leaf_paths
from distributed import run_ranks
from fzero import checkpoint as ck
from fzero.checkpoint import lock
from fzero.checkpoint.form import saved_form
from helpers import (
    CKPT_COMMITTED, assert_views_equal, ckpt_engine, ckpt_entries, ckpt_fresh_engine, ckpt_params,
    ckpt_paths_shapes, ckpt_steps, ckpt_trained, file_contents, flip_byte, global_view, grads_like, snapshot_dir,
)


K, M = 4, 3  # save after K steps, then M more per link of the chain
BUCKETS = {"bucket_bytes": 24}  # several buckets


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


def reference_views(steps):
    """One process, no group: snapshots after each count in ``steps``."""
    engine = ckpt_engine()
    params, state, ss = engine.init(ckpt_params())
    out, done = {}, 0
    for s in steps:
        params, state, ss = ckpt_steps(engine, params, state, ss, range(done, s))
        done = s
        out[s] = global_view(engine, state, ss)
    return out


def stage_a(rank, world_size, tmp):
    """World 2: save (twice: a new path, then over the old checkpoint), resume exactly."""
    c = os.path.join(tmp, "c")
    engine = ckpt_engine()
    params, state, ss = engine.init(ckpt_params())
    params, state, ss = ckpt_steps(engine, params, state, ss, range(K - 1))
    ck.save(c, params, state, ss, engine, extra={"step": K - 1})
    params, state, ss = ckpt_steps(engine, params, state, ss, range(K - 1, K))
    ck.save(c, params, state, ss, engine, extra={"step": K, "note": "a"})
    at_save = global_view(engine, state, ss)
    ck.export_full(os.path.join(tmp, "master.safetensors"), state, engine)
    ck.export_full(os.path.join(tmp, "params.safetensors"), params, engine)
    saved_params = fzero.flatten(params, engine.layout)
    straight = global_view(engine, *ckpt_steps(engine, params, state, ss, range(K, K + M))[1:])

    fresh = ckpt_engine()
    fresh.init(ckpt_params(seed=7))  # other values: everything must come from the checkpoint
    p2, s2, ss2, extra = ck.load(c, fresh)
    loaded = global_view(fresh, s2, ss2)
    params_equal = torch.equal(fzero.flatten(p2, fresh.layout), saved_params)
    resumed = global_view(fresh, *ckpt_steps(fresh, p2, s2, ss2, range(K, K + M))[1:])

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
        "entries": ckpt_entries(c),
    }


def stage_b(rank, world_size, tmp):
    """World 3, another alignment and several buckets: errors agreed by all ranks, then load c."""
    c = os.path.join(tmp, "c")
    if rank == 0:  # a copy with a flipped byte in the data of rank 1's shard
        shutil.copytree(c, c + "_bad")
        flip_byte(os.path.join(snapshot_dir(c + "_bad"), "shard-00001-of-00002.safetensors"))
    dist.barrier()
    engine = ckpt_engine(alignment=8, **BUCKETS)
    engine.init(ckpt_params(seed=3))
    errors = {"corrupted": load_error(c + "_bad", engine)}
    other = ckpt_engine()
    other.init(ckpt_params(z_shape=(23, 17)))
    errors["model"] = load_error(c, other)
    sgd = fzero.zero1(transforms.sgd(lr=0.1, momentum=0.9), param_dtype=torch.float16)
    sgd.init(ckpt_params())
    errors["transform"] = load_error(c, sgd)

    params, state, ss, extra = ck.load(c, engine)
    loaded = global_view(engine, state, ss)
    params, state, ss = ckpt_steps(engine, params, state, ss, range(K, K + M))
    after = global_view(engine, state, ss)
    ck.save(os.path.join(tmp, "c3"), params, state, ss, engine, extra={"step": K + M})
    return {"loaded": loaded, "after": after, "errors": errors, "buckets": len(engine.layout.buckets)}


def stage_d(rank, world_size, tmp):
    """World 4 with alignment 256: ranks 2 and 3 own only padding (empty shard files)."""
    engine = ckpt_engine(alignment=256)
    engine.init(ckpt_params(seed=4))
    params, state, ss, extra = ck.load(os.path.join(tmp, "c1"), engine)
    loaded = global_view(engine, state, ss)
    params, state, ss = ckpt_steps(engine, params, state, ss, range(K + 2 * M, K + 3 * M))
    after = global_view(engine, state, ss)
    ck.save(os.path.join(tmp, "c4"), params, state, ss, engine)
    return {"loaded": loaded, "after": after, "extra": json.dumps(extra)}


@pytest.mark.multirank
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
    assert int(a["at_save"]["tx_state/0/count"]) == K - 1  # step CKPT_BAD_STEP was skipped (and the scale backed off)
    assert "shard-00001-of-00002.safetensors" in a["missing"] and "missing" in a["missing"]
    assert ": ranks 0, 1: shard file" in a["missing"]  # agreed: every rank raised the same error
    # nothing next to the checkpoint; in it the marker, the pointer, the current and the previous snapshot
    assert a["listing"] == ["c", "c_missing", "master.safetensors", "params.safetensors"], a["listing"]
    assert a["entries"] == CKPT_COMMITTED, a["entries"]

    # export_full: the consolidated FP32 master and FP16 params, keyed by leaf path
    master = load_file(os.path.join(tmp, "master.safetensors"))
    params = load_file(os.path.join(tmp, "params.safetensors"))
    paths, shapes = ckpt_paths_shapes()
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
    engine = ckpt_engine()
    engine.init(ckpt_params(seed=5))
    params, state, ss, extra = ck.load(os.path.join(tmp, "c3"), engine)
    assert extra == {"step": K + M}
    assert_views_equal(global_view(engine, state, ss), b["after"])  # 3 -> 1 bitwise
    params, state, ss = ckpt_steps(engine, params, state, ss, range(K + M, K + 2 * M))
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
    engine = ckpt_engine()
    engine.init(ckpt_params())
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


def test_save_load_same_engine_bitwise_params_and_extra_validation(saved, tmp_path):
    path, engine, params, state, ss = saved
    p2, s2, ss2, extra = ck.load(path, ckpt_fresh_engine())
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
    engine.init(ckpt_params())
    params, state, ss, _ = ck.load(path, engine)
    assert float(ss.scale) == 1.0 and params["w"].dtype == torch.bfloat16


def test_export_full_round_trip_one_process(saved, tmp_path):
    path, engine, params, state, ss = saved
    ck.export_full(str(tmp_path / "p.safetensors"), params, engine)
    ck.export_full(str(tmp_path / "m.safetensors"), state, engine)
    got_p = load_file(str(tmp_path / "p.safetensors"))
    got_m = load_file(str(tmp_path / "m.safetensors"))
    paths, leaves, _ = leaf_paths(params)
    masters = optree.tree_leaves(fzero.unflatten(state.master, engine.layout))
    for p, leaf, m in zip(paths, leaves, masters):
        assert got_p[p].dtype == torch.float16 and torch.equal(got_p[p], leaf)
        assert got_m[p].dtype == torch.float32 and torch.equal(got_m[p], m)
    assert sorted(got_p) == sorted(paths) == sorted(got_m)
    assert os.listdir(tmp_path).count("p.safetensors") == 1 and not glob.glob(str(tmp_path / "*.tmp-*"))
    with pytest.raises(ck.CheckpointError, match=r"moments=True\) needs the ZeroState"):
        ck.export_full(str(tmp_path / "x.safetensors"), params, engine, moments=True)


@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_save_accepts_the_flat_buffer_that_step_accepts(tmp_path, master):
    kw = {"master": "remainder", "param_dtype": torch.bfloat16} if master == "remainder" else {}
    engine = fzero.zero1(transforms.adamw(lr=1e-2, weight_decay=0.1), **{"param_dtype": torch.float16, **kw})
    params, state, ss = engine.init(ckpt_params())
    flat = engine.flat_params(params)
    grads = optree.tree_map(lambda g: g.to(engine.param_dtype), grads_like(ckpt_params(), 1))
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
    params0, state, ss = engine.init(ckpt_params())
    params = params0
    for i in range(5):
        grads = optree.tree_map(lambda g: g.to(torch.bfloat16), grads_like(ckpt_params(), i))
        params, state, ss, _ = engine.step(params, grads, state, ss)
    path = str(tmp_path / "ck")
    ck.save(path, params, state, ss, engine)
    before = sorted(os.listdir(path))
    if master == "remainder":
        with pytest.raises(ck.CheckpointError, match="checkpoint.save: these params were not written together with this state"):
            ck.save(path, params0, state, ss, engine)
    else:  # the FP32 master does not read them, but they are not its cast (lineage.checked_fp32_master)
        with pytest.raises(ck.CheckpointError, match="checkpoint.save: the params differ from the master weights"):
            ck.save(str(tmp_path / "other"), params0, state, ss, engine)
    with torch.no_grad():
        params["w"].zero_()
    with pytest.raises(ck.CheckpointError, match="checkpoint.save: the params were written in place"):
        ck.save(path, params, state, ss, engine)
    assert sorted(os.listdir(path)) == before  # nothing written, the checkpoint as it was
    _, loaded, _, _ = ck.load(path, engine)
    assert torch.equal(loaded.master, state.master)


def mask_without_w(p):
    """Like ``ckpt_engine``'s mask, but ``w`` does not decay and ``z`` only in its first 5 rows."""
    out = optree.tree_map(lambda x: x.ndim > 1, p)
    out["w"] = False
    out["z"] = (torch.arange(p["z"].shape[0]) < 5)[:, None].expand(p["z"].shape)
    return out


def other_mask_engine():
    tx = transforms.adamw(lr=transforms.linear_warmup(1e-3, 1e-2, 3), weight_decay=0.1, weight_decay_mask=mask_without_w)
    return fzero.zero1(tx, param_dtype=torch.float16, loss_scale=fzero.DynamicLossScale(init_scale=16.0))


def two_ranks(rank, world_size, tmp):
    engine = ckpt_engine()
    params, state, ss = ckpt_trained(engine, 2)
    try:
        ck.save(os.path.join(tmp, "locked"), params, state, ss, engine)
        out = {"locked": "saved"}
    except ck.CheckpointError as e:
        out = {"locked": str(e)}
    out["different"] = load_error(os.path.join(tmp, f"c{rank}"), engine)
    out["copy"] = load_error(os.path.join(tmp, "c0" if rank == 0 else "c0_copy"), engine)
    other = other_mask_engine()
    _, fresh_state, fresh_ss = other.init(ckpt_params(seed=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, s, sc, _ = ck.load(os.path.join(tmp, "c0"), other)
    out["warnings"] = [str(w.message) for w in caught]
    out["engine_mask"] = global_view(other, s, sc)["tx_state/1/mask"]
    out["fresh_mask"] = global_view(other, fresh_state, fresh_ss)["tx_state/1/mask"]
    _, s, sc, _ = ck.load(os.path.join(tmp, "c0"), other, hyperparams="checkpoint")
    out["saved_mask"] = global_view(other, s, sc)["tx_state/1/mask"]
    return out


@pytest.mark.multirank
def test_two_ranks_a_locked_path_different_paths_and_a_changed_mask(tmp_path):
    """One 2-rank job: a save to a path another job is saving to fails on every rank and changes
    nothing; a load whose ranks were given different checkpoints says so, naming each rank's
    path (a copy reached by another path is the same checkpoint: fine); a weight-decay mask
    that differs from the checkpoint's follows the hyperparameters' rule, named leaf by leaf."""
    tmp = str(tmp_path)
    for name, seed in (("locked", 2), ("c0", 0), ("c1", 1)):
        engine = ckpt_engine()
        params, state, ss = ckpt_trained(engine, 3, seed=seed)
        ck.save(os.path.join(tmp, name), params, state, ss, engine, extra={"v": name})
    shutil.copytree(os.path.join(tmp, "c0"), os.path.join(tmp, "c0_copy"))
    saved_mask = global_view(engine, state, ss)["tx_state/1/mask"]  # c0's and c1's
    locked = os.path.join(tmp, "locked")
    held = lock.acquire(locked)  # another job's save in progress (this process)
    try:
        before = file_contents(locked)
        r = run_ranks(two_ranks, 2, tmp)
        assert file_contents(locked) == before
    finally:
        lock.release(held)
    assert r[0]["locked"] == r[1]["locked"], r  # agreed: every rank raised the same error
    assert r[0]["locked"].startswith(f"save {locked}: rank 0: another save to {locked} is in progress (pid {os.getpid()} ")
    assert ck.load(locked, ckpt_fresh_engine())[3] == {"v": "locked"}  # the previous checkpoint

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


# ---------------------------------------------------------------- moments stored in BF16 or 8 bits
MOMENTS = {"fp32": None, "bf16": torch.bfloat16, "int8": torch.int8}


def moments_view(engine, state, ss):
    """``global_view`` of the state as a checkpoint holds it (8-bit moments dequantized)."""
    return global_view(engine, saved_form(state, engine.shard_context), ss)


def check_loaded_moments(engine, state, saved_view, rank):
    """The loaded moments are the saved ones (FP32), stored as ``engine`` stores them: equal,
    rounded to BF16, or quantized into this engine's blocks (codes and scales bitwise)."""
    paths, shapes = ckpt_paths_shapes()
    adam = state.tx_state[0]
    for name, got in (("mu", adam.mu), ("nu", adam.nu)):
        full = saved_view[f"tx_state/0/{name}"]
        tree = engine.layout.treespec.unflatten(list(torch.split(full, [s.numel() for s in shapes])))
        tree = optree.tree_map(lambda x, s: x.view(s), tree, engine.layout.treespec.unflatten(list(shapes)))
        want = fzero.tree_shard(tree, engine.layout, rank, dtype=torch.float32)
        if isinstance(got, transforms.quantize.Quantized):
            again = transforms.quantize.quantize(want, signed=name == "mu")
            assert torch.equal(got.codes, again.codes) and torch.equal(got.scale, again.scale), name
        else:
            assert torch.equal(got, want.to(got.dtype)), name


def saves_int8_at_two_ranks(rank, world_size, tmp):
    engine = ckpt_engine(torch.int8)
    params, state, ss = ckpt_trained(engine, K)
    ck.save(os.path.join(tmp, "q2"), params, state, ss, engine)
    ck.export_full(os.path.join(tmp, "q2.safetensors"), state, engine, moments=True)
    again = ckpt_engine(torch.int8)
    again.init(ckpt_params(seed=1))
    _, loaded, _, _ = ck.load(os.path.join(tmp, "q2"), again)  # same world size and dtype: exact
    same = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(loaded), optree.tree_leaves(state)))
    return {"view": moments_view(engine, state, ss), "exact_resume": same}


def loads_at_three_ranks(rank, world_size, tmp, saved_view):
    out = {}
    for name, moments in MOMENTS.items():
        engine = ckpt_engine(moments)
        engine.init(ckpt_params(seed=2))
        _, state, _, _ = ck.load(os.path.join(tmp, "q1"), engine)
        check_loaded_moments(engine, state, saved_view, rank)
        out[name] = engine.layout.shard_numel
    return out


@pytest.mark.multirank
def test_moments_load_into_any_moment_dtype_at_any_world_size(tmp_path):
    """8-bit moments saved at 2 ranks load at 1 into FP32, BF16 and 8-bit engines; BF16 moments
    saved at 1 load at 3 into all three. A checkpoint holds the moments dequantized to FP32."""
    tmp = str(tmp_path)
    a = run_ranks(saves_int8_at_two_ranks, 2, tmp)
    assert all(r["exact_resume"] for r in a)  # codes and scales back bit for bit
    saved_view = a[0]["view"]
    entries = {e["name"]: e for e in ck.read_manifest(os.path.join(tmp, "q2"))["state"]}
    assert entries["tx_state/0/mu"]["dtype"] == entries["tx_state/0/nu"]["dtype"] == "float32"
    assert not any("codes" in n or "scale" in n for n in entries)
    exported = load_file(os.path.join(tmp, "q2.safetensors"))  # export_full(moments=True): FP32, by leaf path
    paths, shapes = ckpt_paths_shapes()
    for name in ("mu", "nu"):
        for path, flat in zip(paths, torch.split(saved_view[f"tx_state/0/{name}"], [s.numel() for s in shapes])):
            got = exported[f"tx_state/0/{name}/{path}"]
            assert got.dtype == torch.float32 and torch.equal(got, flat.view(got.shape)), (name, path)
    assert len(exported) == 3 * len(paths)  # the master, mu and nu; no mask
    for moments in MOMENTS.values():  # 2 -> 1
        engine = ckpt_engine(moments)
        engine.init(ckpt_params(seed=3))
        params, state, ss, _ = ck.load(os.path.join(tmp, "q2"), engine)
        check_loaded_moments(engine, state, saved_view, 0)
        if moments == torch.bfloat16:
            params, state, ss = ckpt_steps(engine, params, state, ss, range(K, K + 2))
            ck.save(os.path.join(tmp, "q1"), params, state, ss, engine)
            bf16_view = moments_view(engine, state, ss)
    assert bf16_view["tx_state/0/mu"].dtype == torch.bfloat16
    run_ranks(loads_at_three_ranks, 3, tmp, bf16_view)  # 1 -> 3, each rank checks its shard


def test_arguments_out_of_order_name_the_call_and_what_came_instead(ready, tmp_path):
    """The engine where another argument was expected (or that argument where the engine was) is a
    TypeError naming the call's signature and the type that came, before anything is written."""
    engine, params, state, ss, _ = ready
    calls = [
        (lambda: ck.save(tmp_path / "a", engine, params, state, ss), "save(path, params, state, scaler_state, engine)",
         "LossScaleState"),
        (lambda: ck.load(tmp_path / "a", params), "load(path, engine)", "dict"),
        (lambda: ck.export_full(tmp_path / "x.safetensors", engine, params), "export_full(path, params_or_state, engine)",
         "dict"),
        (lambda: ck.full_master(params, engine, state), "full_master(params, state, engine)", "ZeroState"),
    ]
    for call, where, got in calls:
        with pytest.raises(TypeError, match=re.escape(f"fzero.checkpoint.{where}: the engine argument is a {got},")):
            call()
    assert list(tmp_path.iterdir()) == []
