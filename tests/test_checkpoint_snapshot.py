"""Opening a snapshot (fzero.checkpoint.snapshot): a damaged shard, manifest or pointer, and a
checkpoint of another model or transform, each named in the error."""
import glob
import os
import shutil

import optree
import pytest
import torch

import fzero
from fzero import transforms
from fzero import checkpoint as ck
from fzero.checkpoint import commit
from helpers import ckpt_engine, ckpt_fresh_engine, ckpt_params, edit_manifest, flip_byte, snapshot_dir


def shard_files(path):
    return sorted(glob.glob(os.path.join(snapshot_dir(path), "shard-*.safetensors")))


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
            ck.load(bad, ckpt_fresh_engine())
        assert os.path.join(bad, shard) in str(e.value)
    # a flipped byte in the data is caught by the checksum only: with verify=False it loads
    flipped = f"{path}_flip"
    ck.load(flipped, ckpt_fresh_engine(), verify=False)

    os.remove(os.path.join(snapshot_dir(f"{path}_cut"), "manifest.json"))
    with pytest.raises(ck.CheckpointError, match="manifest.json is missing"):
        ck.load(f"{path}_cut", ckpt_fresh_engine())
    with open(os.path.join(snapshot_dir(path + "_gone"), "manifest.json"), "w") as f:
        f.write('{"format": "fzero-checkpoint", "vers')
    with pytest.raises(ck.CheckpointError, match=r"_gone/snapshot-\w+/manifest.json is corrupted: sha256 \w+ but .*current.json says"):
        ck.load(path + "_gone", ckpt_fresh_engine())
    edit_manifest(path + "_gone", lambda text: text)  # the pointer now vouches for the truncated text
    with pytest.raises(ck.CheckpointError, match=r"cannot read .*_gone/snapshot-\w+/manifest.json"):
        ck.load(path + "_gone", ckpt_fresh_engine())
    with open(os.path.join(path + "_flip", commit.POINTER), "w") as f:
        f.write('{"format": "fzero-checkpoint", "version": 2, "snapshot": "../elsewhere", "manifest_sha256": "00"}')
    with pytest.raises(ck.CheckpointError, match=r"current.json: pointer field snapshot = '../elsewhere': must match"):
        ck.load(path + "_flip", ckpt_fresh_engine())
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.load(path + "_nope", ckpt_fresh_engine())


def test_incompatible_model_or_transform_names_the_leaf(saved):
    path, *_ = saved
    engine = ckpt_engine()
    engine.init(ckpt_params(z_shape=(23, 17)))
    with pytest.raises(ck.CheckpointError, match=r"leaf 'z' has shape \(17, 23\) in the checkpoint but \(23, 17\) \(transposed\)"):
        ck.load(path, engine)
    p = ckpt_params()
    del p["one"]
    engine = ckpt_engine()
    engine.init(p)
    with pytest.raises(ck.CheckpointError, match="checkpoint leaf 'one' .* is not in this model"):
        ck.load(path, engine)
    p = ckpt_params()
    p["extra_bias"] = torch.zeros(3)
    engine = ckpt_engine()
    engine.init(p)
    with pytest.raises(ck.CheckpointError, match="model leaf 'extra_bias' .* is not in the checkpoint"):
        ck.load(path, engine)
    engine = fzero.zero1(transforms.adamw(lr=1e-3), param_dtype=torch.float16)  # no mask, no schedule
    engine.init(ckpt_params())
    with pytest.raises(ck.CheckpointError, match="state leaf 'tx_state/1/inner/weight_decay' .* is not in this engine's optimizer state"):
        ck.load(path, engine)
    # FP32 and BF16 moments convert on load (test_checkpoint.py); other dtypes must match
    engine = ckpt_engine()
    base = engine.tx

    def fp16_moment(params, *, context=None):
        adam, *rest = base.init(params, context=context)
        return (adam._replace(mu=adam.mu.half()), *rest)

    engine.tx = base._replace(init=fp16_moment)
    engine.init(ckpt_params())
    with pytest.raises(ck.CheckpointError, match="'tx_state/0/mu' is shard float32 in the checkpoint but shard float16"):
        ck.load(path, engine)
